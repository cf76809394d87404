"""Configuration from environment variables: one declaration per setting.

Each field of ``Settings`` names its variable, its one default, its allowed values and the
README's sentence about it. ``Settings.from_env`` parses and checks every variable, and any
``Settings(...)`` is checked too, so a bad value stops the process at start-up with one line
naming the variable and what it accepts (``SettingsError``; the CLI exits with status 2). The
README's configuration table is generated from these declarations
(``python -m service.platform.settings``) and a test keeps the two equal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from service.platform.crypto import KeyFileError, MasterKeys, read_master_keys
from service.platform.providers_file import ProvidersFile, ProvidersFileError, read_providers_file


class SettingsError(ValueError):
    """A variable is malformed or out of range; the message names it and what it accepts."""


class Above(float):
    """A lower bound that is not allowed itself: ``low=Above(0)`` accepts any number above 0."""


def _setting(
    env: str,
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] = (),
    secret: bool = False,
    shown: str | None = None,
) -> Any:
    """A field of Settings. ``low``/``high`` bound a number inclusively (``low=Above(x)``:
    exclusively); ``shown`` is the default as the README states it (when the value itself says
    little). ``{choices}`` in ``doc`` names the ``choices``, so they are written once."""
    above = low if isinstance(low, Above) else None
    if choices:
        *rest, last = (f"`{choice}`" for choice in choices)
        doc = doc.replace("{choices}", f"{', '.join(rest)} or {last}" if rest else last)
    meta: dict[str, Any] = {"env": env, "doc": doc, "high": high, "choices": choices}
    meta |= {"low": None if above is not None else low, "above": above, "shown": shown}
    return field(default=default, repr=not secret, metadata=meta)


_KIB, _MIB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Settings:
    database_url: str | None = _setting(
        "DATABASE_URL",
        None,
        "`postgresql+asyncpg://…` (`postgres://` and `postgresql://` are accepted)",
        secret=True,
        shown="unset: embedded PostgreSQL",
    )
    database_listen_url: str | None = _setting(
        "DATABASE_LISTEN_URL",
        None,
        "where each replica LISTENs for its wake-ups (one connection); set it to the server "
        "itself when `DATABASE_URL` goes through PgBouncer in transaction mode",
        secret=True,
        shown="`DATABASE_URL`",
    )
    encryption_keys_file: Path | None = _setting(
        "ENCRYPTION_KEYS_FILE",
        None,
        "master keys, one `<key id>:<base64 of 32 random bytes>` per line (the first encrypts, "
        "all decrypt); set: transcripts, replay items, tool calls, events and metadata are "
        "stored encrypted under per-owner data keys",
        shown="unset: stored in clear",
    )
    keyring_database_url: str | None = _setting(
        "KEYRING_DATABASE_URL",
        None,
        "where owners' data keys live, wrapped by a master key; a database of its own (and its "
        "own backups) makes `turnstore owners shred` reach the data's backups too",
        secret=True,
        shown="`DATABASE_URL`",
    )
    llm_provider: str = _setting(
        "LLM_PROVIDER",
        "fake",
        "{choices}",
        choices=("fake", "openai", "azure", "anthropic", "gemini", "chat"),
    )
    providers_file: Path | None = _setting(
        "PROVIDERS_FILE",
        None,
        "a TOML file of named providers, each serving its own models, routed by a request's "
        "model (README: Providers); instead of `LLM_PROVIDER` and its variables",
    )
    openai_base_url: str = _setting(
        "OPENAI_BASE_URL",
        "https://api.openai.com/v1",
        "requests go to `{base}/responses` with `Authorization: Bearer`",
    )
    openai_api_key: str | None = _setting("OPENAI_API_KEY", None, "for `openai`", secret=True)
    openai_model: str | None = _setting("OPENAI_MODEL", None, "for `openai`")
    azure_endpoint: str | None = _setting(
        "AZURE_OPENAI_ENDPOINT", None, "for `azure`: `{endpoint}/openai/v1/responses`"
    )
    azure_api_key: str | None = _setting(
        "AZURE_OPENAI_API_KEY", None, "for `azure` (sent as the `api-key` header)", secret=True
    )
    azure_deployment: str | None = _setting(
        "AZURE_OPENAI_DEPLOYMENT", None, "for `azure`: the deployment (the model)"
    )
    anthropic_base_url: str = _setting(
        "ANTHROPIC_BASE_URL",
        "https://api.anthropic.com",
        "for `anthropic`: requests go to `{base}/v1/messages` with `x-api-key`",
    )
    anthropic_api_key: str | None = _setting(
        "ANTHROPIC_API_KEY", None, "for `anthropic`", secret=True
    )
    anthropic_model: str | None = _setting("ANTHROPIC_MODEL", None, "for `anthropic`")
    anthropic_max_tokens: int = _setting(
        "ANTHROPIC_MAX_TOKENS",
        8192,
        "`max_tokens` of a Claude request whose client names none (`max_output_tokens`): "
        "Anthropic requires one",
        low=1,
        high=1_000_000,
    )
    gemini_base_url: str = _setting(
        "GEMINI_BASE_URL",
        "https://generativelanguage.googleapis.com",
        "for `gemini`: requests go to `{base}/v1beta/models/{model}:generateContent` (and "
        "`:streamGenerateContent?alt=sse`) with `x-goog-api-key`",
    )
    gemini_api_key: str | None = _setting("GEMINI_API_KEY", None, "for `gemini`", secret=True)
    gemini_model: str | None = _setting("GEMINI_MODEL", None, "for `gemini`")
    chat_base_url: str | None = _setting(
        "CHAT_BASE_URL",
        None,
        "for `chat` (a Chat Completions server: vLLM, Ollama, llama.cpp, SGLang, OpenRouter...): "
        "requests go to `{base}/chat/completions`, streamed with usage",
    )
    chat_api_key: str | None = _setting(
        "CHAT_API_KEY",
        None,
        "for `chat`, sent as `Authorization: Bearer`",
        secret=True,
        shown="unset (no `Authorization`)",
    )
    chat_model: str | None = _setting("CHAT_MODEL", None, "for `chat`")
    upstream_connect_timeout_s: float = _setting(
        "UPSTREAM_CONNECT_TIMEOUT_S",
        10.0,
        "provider connect timeout (seconds)",
        low=Above(0),
        high=600,
    )
    upstream_read_timeout_s: float = _setting(
        "UPSTREAM_READ_TIMEOUT_S", 90.0, "provider read timeout (seconds)", low=Above(0), high=3600
    )
    upstream_max_body_bytes: int = _setting(
        "UPSTREAM_MAX_BODY_BYTES",
        262_144,
        "a provider reply (its output items, or a stream's text) larger than this is "
        "`upstream_error`, streamed or not, refused while it arrives (the bytes on the wire are "
        "capped at 8 times this, at least 16 MiB)",
        low=1,
        high=1024 * _MIB,
    )
    max_body_bytes: int = _setting(
        "MAX_BODY_BYTES",
        _MIB,
        "larger request bodies get `413 payload_too_large`",
        low=1,
        high=64 * _MIB,
    )
    max_message_chars: int = _setting(
        "MAX_MESSAGE_CHARS",
        100_000,
        "longer messages get `400 invalid_input`",
        low=1,
        high=16 * _MIB,
    )
    system_prompt_file: Path | None = _setting(
        "SYSTEM_PROMPT_FILE",
        None,
        "versioned system prompt sent as `instructions`; never stored in history",
    )
    instructions: str = _setting(
        "INSTRUCTIONS",
        "append",
        "a `/v1` request's `instructions`: sent after the server's prompt (`append`), instead "
        "of it (`client`), or refused with 400 (`server`); they apply to that response only",
        choices=("append", "client", "server"),
    )
    models: str | None = _setting(
        "MODELS",
        None,
        "the models a `/v1` request may name besides the configured one (comma-separated; `*`: "
        "any); `GET /v1/models` lists them",
        shown="the configured model (with the built-in `fake`: any)",
    )
    context_max_turns: int | None = _setting(
        "CONTEXT_MAX_TURNS",
        None,
        "at most this many earlier turns in a provider request",
        low=0,
        high=1_000_000,
        shown="unlimited",
    )
    context_max_request_bytes: int = _setting(
        "CONTEXT_MAX_REQUEST_BYTES",
        _MIB,
        "the serialised provider request's size limit (the context window, below)",
        low=1,
        high=1024 * _MIB,
    )
    owner_max_running_turns: int = _setting(
        "OWNER_MAX_RUNNING_TURNS",
        16,
        "turns one owner may have running at once on the whole fleet (plain, streamed and "
        "background; counted in PostgreSQL); past it `429 too_many_requests`, the provider not "
        "called. Each running turn is a provider call on the operator's key and a held request:"
        " 16 covers a person's tabs and an app's burst, not a loop. With `AUTH_MODE=none` every "
        "client is one owner: raise it to what the whole deployment may run at once",
        low=1,
        high=1_000_000,
    )
    owner_max_event_readers: int = _setting(
        "OWNER_MAX_EVENT_READERS",
        32,
        "open event readers (`GET /api/v1/turns/{id}/events`, `GET /v1/responses/{id}?stream=true`)"
        " per owner on one replica; past it `429 too_many_requests`. Each reader holds a stream "
        "and a poll of the database: 32 covers a user's tabs and devices, not a fan-out",
        low=1,
        high=100_000,
    )
    max_conversation_bytes: int = _setting(
        "MAX_CONVERSATION_BYTES",
        64 * _MIB,
        "what one conversation may hold: every byte stored for it (items as sent, texts, "
        "transcript, tool calls, compacted items, the request fields a `/v1` Response echoes); "
        "a turn, item append or fork past it is `422 conversation_full`. A turn reads only its "
        "context window, so this bounds the disk and WAL one conversation takes, not a "
        "replica's memory; 64 MiB is far past any model's context (~1 MB) and leaves room for "
        "long tool transcripts",
        low=1024,
        high=1024 * _MIB,
    )
    owner_max_forks_per_minute: int = _setting(
        "OWNER_MAX_FORKS_PER_MINUTE",
        30,
        "forks one owner may make in a minute, fleet-wide (`POST …/fork` and `previous_response_id`"
        " forks); past it `429 too_many_requests`. A fork copies its source inside the database "
        "(WAL as large as the copied turns): 30 a minute is a person exploring branches, not a "
        "loop filling the disk",
        low=1,
        high=1_000_000,
    )
    owner_max_write_bytes_per_minute: int = _setting(
        "OWNER_MAX_WRITE_BYTES_PER_MINUTE",
        256 * _MIB,
        "what one owner's writes may store in a minute through one replica (turns, item "
        "appends, new conversations, forks: a fork's copy counts), a bucket refilled at this "
        "rate; past it `429 too_many_requests` before any provider call, nothing kept. In any "
        "minute one owner writes at most twice this and one request more per replica (README, "
        "Limits). With `AUTH_MODE=none` every client is one owner",
        low=1024,
        high=1024 * 1024 * _MIB,
    )
    owner_max_queued_turns: int = _setting(
        "OWNER_MAX_QUEUED_TURNS",
        64,
        "turns of one owner that may wait in conversations' queues at once on one replica "
        "(`TURN_CONCURRENCY=queue`); past it `429 too_many_requests`, the provider not called",
        low=1,
        high=1_000_000,
    )
    context_strategy: str = _setting(
        "CONTEXT_STRATEGY",
        "drop",
        "how a long conversation stays within the model's context: `drop` its oldest whole "
        "turns (the window's limits above), or `compact` them first into the provider's opaque "
        "compaction item once a turn's input passes `COMPACT_THRESHOLD_TOKENS` (Compaction, "
        "below)",
        choices=("drop", "compact"),
    )
    compact_threshold_tokens: int = _setting(
        "COMPACT_THRESHOLD_TOKENS",
        100_000,
        "with `CONTEXT_STRATEGY=compact`, or a `/v1` `context_management` entry without its "
        "`compact_threshold`: the input, in the provider's tokens, above which a turn compacts",
        low=1,
        high=100_000_000,
    )
    tools: str | None = _setting(
        "TOOLS", None, "comma-separated import paths of read-only tools (Tools, below)"
    )
    tool_max_rounds: int = _setting(
        "TOOL_MAX_ROUNDS",
        4,
        "provider rounds per turn before the turn fails with `upstream_error`",
        low=1,
        high=64,
    )
    tool_timeout_s: float = _setting(
        "TOOL_TIMEOUT_S", 5.0, "how long one tool call is waited for", low=Above(0), high=3600
    )
    tool_workers: int = _setting(
        "TOOL_WORKERS", 1, "tool executor threads per process (no queue)", low=1, high=1024
    )
    tool_call_budget: int = _setting(
        "TOOL_CALL_BUDGET", 8, "admitted tool calls per turn", low=0, high=1024
    )
    turn_concurrency: str = _setting(
        "TURN_CONCURRENCY",
        "queue",
        "a turn that finds its conversation's lease taken waits for it (`queue`) or fails at "
        "once with `409 conversation_busy` (`reject`)",
        choices=("queue", "reject"),
    )
    turn_queue_wait_s: float = _setting(
        "TURN_QUEUE_WAIT_S",
        30.0,
        "how long a queued turn waits for the lease before `409 conversation_busy`",
        low=0,
        high=3600,
    )
    turn_lease_s: float = _setting(
        "TURN_LEASE_S",
        30.0,
        "a turn lease expires this long after its holder stops renewing it (renewed every "
        "third of it)",
        low=1,
        high=3600,
    )
    turn_events_ttl_s: float = _setting(
        "TURN_EVENTS_TTL_S",
        600.0,
        "how long a finished turn's events (and status) stay readable",
        low=1,
        high=30 * 86_400,
    )
    retention_days: float | None = _setting(
        "RETENTION_DAYS",
        None,
        "idle conversations older than this are gone (404) at once and removed by "
        "`turnstore purge`",
        low=Above(0),
        high=36_500,
    )
    stored_response_ttl_days: float = _setting(
        "STORED_RESPONSE_TTL_DAYS",
        30.0,
        "a stored `/v1` response (one made without a conversation) is gone this long after its "
        "conversation's last turn, and removed by `turnstore purge`",
        low=Above(0),
        high=36_500,
    )
    idempotency_ttl_s: float = _setting(
        "IDEMPOTENCY_TTL_S",
        86_400.0,
        "how long an `Idempotency-Key` is remembered",
        low=Above(0),
        high=365 * 86_400,
    )
    data_dir: Path = _setting(
        "TURNSTORE_DATA_DIR", Path(".turnstore"), "where the embedded PostgreSQL keeps its data"
    )
    db_pool_size: int = _setting(
        "DB_POOL_SIZE",
        10,
        "database connections per process (a hard limit: no overflow)",
        low=1,
        high=1000,
    )
    db_statement_cache_size: int = _setting(
        "DB_STATEMENT_CACHE_SIZE",
        100,
        "prepared statements cached per connection; 0 turns the caches off and prepares "
        "every statement unnamed, as PgBouncer in transaction mode needs (`deploy/README.md`)",
        low=0,
        high=100_000,
    )
    migration_lock_timeout_s: float = _setting(
        "MIGRATION_LOCK_TIMEOUT_S",
        2.0,
        "`turnstore db upgrade`/`downgrade`: the longest a migration waits for a lock (so the "
        "turns queued behind it) before it is rolled back, backs off and retries",
        low=Above(0),
        high=600,
    )
    sse_keepalive_s: float = _setting(
        "SSE_KEEPALIVE_S",
        15.0,
        "a `: keep-alive` comment after this long without an event",
        low=0.01,
        high=3600,
    )
    client_send_timeout_s: float = _setting(
        "CLIENT_SEND_TIMEOUT_S",
        30.0,
        "a response (or stream event) a client does not take within this long ends its request, "
        "as a disconnect does",
        low=Above(0),
        high=3600,
    )
    http_header_timeout_s: float = _setting(
        "HTTP_HEADER_TIMEOUT_S",
        10.0,
        "a connection whose request head has not fully arrived this long after it began is "
        "closed (slow clients)",
        low=Above(0),
        high=600,
    )
    http_keepalive_s: float = _setting(
        "HTTP_KEEPALIVE_S",
        5.0,
        "an idle kept-alive connection is closed after this long",
        low=Above(0),
        high=600,
    )
    shutdown_grace_s: float = _setting(
        "SHUTDOWN_GRACE_S",
        30.0,
        "on SIGTERM, how long requests in flight may still run",
        low=0,
        high=3600,
    )
    history_cache_bytes: int = _setting(
        "HISTORY_CACHE_BYTES",
        64 * _MIB,
        "replica-local history cache (LRU by bytes); 0 turns it off",
        low=0,
        high=1 << 40,
    )
    log_format: str = _setting(
        "LOG_FORMAT",
        "json",
        "`json` (one object per line, with `correlation_id`) or `text`",
        choices=("json", "text"),
    )
    log_level: str = _setting(
        "LOG_LEVEL",
        "info",
        "{choices}: the least severe log lines written",
        choices=("debug", "info", "warning", "error"),
    )
    # Authentication (service/auth.py). Secrets stay out of repr, so out of any log line.
    auth_mode: str = _setting(
        "AUTH_MODE", "none", "{choices} (Security, below)", choices=("none", "api_key", "jwt")
    )
    allowed_hosts: str | None = _setting(
        "ALLOWED_HOSTS",
        None,
        "with `AUTH_MODE=none`, the `Host` names accepted besides `localhost`, `127.0.0.1` and "
        "`[::1]` (comma-separated; `*`: any)",
        shown="loopback names",
    )
    jwt_secret: str | None = _setting(
        "JWT_SECRET", None, "HS256 secret (at least 32 bytes) for `jwt`", secret=True
    )
    jwt_secret_file: Path | None = _setting(
        "JWT_SECRET_FILE", None, "a file holding the HS256 secret, instead of `JWT_SECRET`"
    )
    jwt_public_key_file: Path | None = _setting(
        "JWT_PUBLIC_KEY_FILE", None, "PEM RSA public key(s) or certificates for RS256"
    )
    jwt_issuer: str | None = _setting("JWT_ISSUER", None, "the required `iss` of a JWT")
    jwt_audience: str | None = _setting("JWT_AUDIENCE", None, "the required `aud` of a JWT")

    def __post_init__(self) -> None:
        for spec in fields(self):
            _check(spec.metadata, getattr(self, spec.name))
        for name, url in (
            ("ANTHROPIC_BASE_URL", self.anthropic_base_url),
            ("GEMINI_BASE_URL", self.gemini_base_url),
            ("CHAT_BASE_URL", self.chat_base_url),
        ):
            if url and urlsplit(url).username is not None:
                raise SettingsError(f"{name} must not carry credentials (user:password@)")
        if urlsplit(self.openai_base_url).username is not None:
            # httpx would turn them into Basic auth (replacing the key) and log them.
            raise SettingsError("OPENAI_BASE_URL must not carry credentials (user:password@)")
        if self.encryption_keys_file is not None:
            self.master_keys()  # a malformed or short key stops the process at start-up
        if self.providers_file is not None:
            self.providers()  # so does a bad providers file

    def compact_threshold(self) -> int | None:
        """The threshold every turn compacts at (None: CONTEXT_STRATEGY=drop)."""
        return self.compact_threshold_tokens if self.context_strategy == "compact" else None

    def providers(self) -> ProvidersFile | None:
        """PROVIDERS_FILE read, its keys from the variables it names (None: unset)."""
        if self.providers_file is None:
            return None
        try:
            return read_providers_file(self.providers_file, os.environ)
        except ProvidersFileError as exc:
            raise SettingsError(f"PROVIDERS_FILE: {exc}") from None

    def served_models(self) -> frozenset[str] | None:
        """MODELS as a set (None: any model, `*`, or unset with the built-in fake, which
        answers for any model: a client's default model name works on `make run`); with
        PROVIDERS_FILE, the models it names."""
        named = self.providers()
        if named is not None:
            return frozenset(model for spec in named.providers for model in spec.models)
        if self.models is None and self.llm_provider == "fake":
            return None
        names = {name.strip() for name in (self.models or "").split(",") if name.strip()}
        return None if "*" in names else frozenset(names)

    def master_keys(self) -> MasterKeys | None:
        """The master keys of ENCRYPTION_KEYS_FILE (None: unset)."""
        if self.encryption_keys_file is None:
            return None
        try:
            return read_master_keys(self.encryption_keys_file)
        except KeyFileError as exc:
            raise SettingsError(f"ENCRYPTION_KEYS_FILE: {exc}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment gives; SettingsError for the first bad variable."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = env.get(spec.metadata["env"], "").strip()
            if raw:
                values[spec.name] = _parse(spec.metadata, spec.type, raw)
        return cls(**values)


def _parse(meta: Mapping[str, Any], kind: Any, raw: str) -> Any:
    name, kind = meta["env"], str(kind)
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be {_accepted(meta, kind)}, got {raw!r}") from None
    if kind.startswith("Path"):
        return Path(raw)
    return raw.lower() if meta["choices"] else raw


def _check(meta: Mapping[str, Any], value: Any) -> None:
    if value is None or (isinstance(value, str | Path) and not meta["choices"]):
        return
    name, low, high, above = meta["env"], meta["low"], meta["high"], meta["above"]
    if meta["choices"]:
        ok = value in meta["choices"]
    else:
        ok = (
            value == value  # not NaN
            and (low is None or value >= low)
            and (high is None or value <= high)
            and (above is None or value > above)
        )
    if not ok:
        kind = "float" if isinstance(value, float) else "int"
        raise SettingsError(f"{name} must be {_accepted(meta, kind)}, got {value!r}")


def _accepted(meta: Mapping[str, Any], kind: str) -> str:
    if meta["choices"]:
        return "one of " + ", ".join(meta["choices"])
    what = "an integer" if kind.startswith("int") else "a number"
    low, high, above = meta["low"], meta["high"], meta["above"]
    if above is not None:
        return f"{what} above {above:g} and at most {high:g}"
    if low is not None and high is not None:
        return f"{what} from {low:g} to {high:g}"
    return what


def markdown_table() -> str:
    """The README's configuration table, from the declarations above."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for spec in fields(Settings):
        meta = spec.metadata
        default = meta["shown"] or ("—" if spec.default is None else f"`{spec.default}`")
        rows.append(f"| `{meta['env']}` | {default} | {meta['doc']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
