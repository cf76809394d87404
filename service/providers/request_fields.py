"""A client's Responses request fields as the adapters that translate them read them
(anthropic_request.py, gemini_request.py, chat_completions_request.py): decoded once into
one value, with every refusal they share, each naming its param. Each adapter then writes the
fields in its own API's form and refuses what its API alone cannot honour.

``Fields.read(fields, models)``: ``models`` names the target in messages ("Anthropic
models"). A field that is neither mapped nor turnstore's own is refused, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from service.core.errors import InvalidInput

# Fields of a client's request that concern turnstore (or caching, which turnstore keeps stable
# itself), never sent: they are honoured, not dropped.
NOT_SENT = frozenset(
    {"metadata", "prompt_cache_key", "prompt_cache_retention", "store", "truncation"}
)
# The fields an adapter maps to its API's.
MAPPED = frozenset(
    {
        "temperature",
        "top_p",
        "max_output_tokens",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "text",
        "user",
        "safety_identifier",
        "service_tier",
    }
)


class Format(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class Text(msgspec.Struct, forbid_unknown_fields=True):
    format: Format | None = None
    verbosity: str | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    effort: str | None = None
    # Where the target's thinking is readable whenever it thinks, a summary asks nothing more.
    summary: str | None = None
    generate_summary: str | None = None


class NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class Tool(msgspec.Struct):
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """Its parameters' JSON schema (an object without properties when it names none)."""
        return self.parameters or {"type": "object", "properties": {}}


ToolChoice = Literal["auto", "required", "none"] | NamedChoice


@dataclass(frozen=True)
class Fields:
    """What a client asked of a turn beyond its input, checked (None: not asked)."""

    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: Text | None = None
    user: str | None = None  # safety_identifier, else user

    @classmethod
    def read(cls, fields: Mapping[str, msgspec.Raw], models: str) -> Fields:
        for name in fields:
            if name not in MAPPED and name not in NOT_SENT:
                raise InvalidInput(f"{name} cannot be sent to {models}.", param=name)
        field = _Reader(fields, models)
        if field("service_tier", str | None) not in (None, "auto", "default"):
            raise InvalidInput(f"{models} take service_tier auto only.", param="service_tier")
        limit: int | None = field("max_output_tokens", int | None)
        if limit is not None and limit < 1:
            raise InvalidInput("max_output_tokens must be at least 1.", param="max_output_tokens")
        return cls(
            temperature=field("temperature", float | None),
            top_p=field("top_p", float | None),
            max_output_tokens=limit,
            tool_choice=field("tool_choice", ToolChoice | None),  # auto, required, none or one
            parallel_tool_calls=field("parallel_tool_calls", bool | None),
            reasoning=field("reasoning", Reasoning | None),
            text=field("text", Text | None),
            user=field("safety_identifier", str | None) or field("user", str | None),
        )


@dataclass(frozen=True)
class _Reader:
    fields: Mapping[str, msgspec.Raw]
    models: str

    def __call__(self, name: str, kind: Any) -> Any:
        """The field decoded as ``kind`` (None when absent); a value of another shape is the
        client's error, named by its param."""
        raw = self.fields.get(name)
        if raw is None:
            return None
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError:
            message = f"{name} has a value {self.models} cannot take."
            raise InvalidInput(message, param=name) from None


def function_tools(tools: msgspec.Raw | None, models: str) -> list[Tool]:
    """The client's tools, each a function (the one kind the translating targets take)."""
    if tools is None:
        return []
    try:
        listed = msgspec.json.decode(tools, type=list[Tool])
    except msgspec.DecodeError:
        raise InvalidInput("tools must be a list of tools.", param="tools") from None
    for tool in listed:
        if tool.type != "function" or not tool.name:
            raise InvalidInput(
                f"{models} take function tools only, not {tool.type!r}.", param="tools"
            )
    return listed
