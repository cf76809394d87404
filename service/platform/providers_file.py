"""PROVIDERS_FILE: several named providers, each serving its own models.

A TOML file (read with ``tomllib``)::

    default_model = "gpt-5"            # optional: else the first model of the first provider

    [providers.openai]
    kind = "openai"                    # openai | azure | anthropic | gemini | chat | fake (KINDS)
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"     # the NAME of the variable holding the key
    models = ["gpt-5", "gpt-5-mini"]

A key never appears in the file: ``api_key_env`` names the environment variable that holds it
(omitted for a server without a key). Anything wrong (a model named twice, an unknown kind, a
key variable that is not set, a missing field) is ``ProvidersFileError``, one line naming it,
which stops the process at start-up like a bad setting.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# The kinds this release serves (every kind the contract names).
KINDS = ("openai", "azure", "anthropic", "gemini", "chat", "fake")
# The kinds that always need a key (a local Chat server has none).
_KEYED = ("azure", "anthropic", "gemini")
_FIELDS = {"kind", "base_url", "api_key_env", "models"}


class ProvidersFileError(ValueError):
    """PROVIDERS_FILE is unreadable or malformed; the message names what and where."""


@dataclass(frozen=True)
class ProviderSpec:
    """One ``[providers.NAME]`` table, its key read from the variable it names."""

    name: str
    kind: str
    base_url: str | None
    api_key: str | None = field(repr=False)  # never in a log or a traceback
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProvidersFile:
    providers: tuple[ProviderSpec, ...]
    default_model: str


def read_providers_file(path: Path, environ: Mapping[str, str]) -> ProvidersFile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ProvidersFileError(f"cannot read {path}: {type(exc).__name__}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProvidersFileError(f"{path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"providers", "default_model"}
    if unknown:
        raise ProvidersFileError(f"unknown top-level key {sorted(unknown)[0]!r}")
    tables = data.get("providers")
    if not isinstance(tables, dict) or not tables:
        raise ProvidersFileError("no [providers.NAME] table")
    specs = tuple(_spec(name, table, environ) for name, table in tables.items())
    served: dict[str, str] = {}
    for spec in specs:
        for model in spec.models:
            if model in served:
                raise ProvidersFileError(
                    f"model {model!r} is served by both {served[model]!r} and {spec.name!r}"
                )
            served[model] = spec.name
    default = data.get("default_model", specs[0].models[0])
    if not _named(default):
        raise ProvidersFileError("default_model must be a model name")
    if default not in served:
        raise ProvidersFileError(f"default_model {default!r} is served by no provider")
    return ProvidersFile(specs, default)


def _spec(name: str, table: Any, environ: Mapping[str, str]) -> ProviderSpec:
    where = f"[providers.{name}]"
    if not isinstance(table, dict):
        raise ProvidersFileError(f"{where} is not a table")
    unknown = set(table) - _FIELDS
    if unknown:
        raise ProvidersFileError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    kind = table.get("kind")
    if kind not in KINDS:
        raise ProvidersFileError(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    models = table.get("models")
    if not isinstance(models, list) or not models or not all(_named(m) for m in models):
        raise ProvidersFileError(f"{where}: models must be a non-empty list of model names")
    if len(set(models)) != len(models):
        raise ProvidersFileError(f"{where}: a model is named twice in its models")
    base_url = table.get("base_url")
    if base_url is not None and not _named(base_url):
        raise ProvidersFileError(f"{where}: base_url must be a string")
    if base_url is not None and urlsplit(base_url).username is not None:
        # httpx would send them as Basic auth (replacing the key) and log them.
        raise ProvidersFileError(f"{where}: base_url must not carry credentials (user:password@)")
    if kind == "azure" and base_url is None:
        raise ProvidersFileError(f"{where}: kind 'azure' needs base_url (the resource endpoint)")
    if kind == "chat" and base_url is None:
        raise ProvidersFileError(f"{where}: kind 'chat' needs base_url (the server's /v1)")
    return ProviderSpec(name, kind, base_url, _key(where, kind, table, environ), tuple(models))


def _key(where: str, kind: str, table: dict[str, Any], environ: Mapping[str, str]) -> str | None:
    variable = table.get("api_key_env")
    if variable is None:
        if kind in _KEYED:
            raise ProvidersFileError(f"{where}: kind {kind!r} needs api_key_env")
        return None
    if not _named(variable):
        raise ProvidersFileError(f"{where}: api_key_env must name an environment variable")
    key = environ.get(variable)
    if not key:
        raise ProvidersFileError(f"{where}: the variable {variable} (api_key_env) is not set")
    return key


def _named(value: object) -> bool:
    """A name: a string, not empty, without spaces around it."""
    return isinstance(value, str) and bool(value) and value == value.strip()
