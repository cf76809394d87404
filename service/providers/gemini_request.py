"""The Gemini API request of a provider request: ``generate_body`` (and ``count_body``).

The conversation comes from ``core/translate/gemini.to_contents`` (Gemini's own parts spliced
byte for byte, other providers' own items as the Responses items they read as). The client's
fields are mapped to Gemini's or refused with their param, never dropped: ``temperature``,
``top_p``, ``max_output_tokens`` into ``generationConfig``, ``text.format`` as
``responseJsonSchema`` (with ``responseMimeType``), ``reasoning.effort`` as ``thinkingConfig``
(a thinking level on Gemini 3, a budget before it), ``reasoning.summary`` as
``includeThoughts``, ``tool_choice`` as ``toolConfig``. Gemini caches by prefix: nothing here
depends on anything but the request, so the request of turn N+1 begins with turn N's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import for_form
from service.core.translate.gemini import GEMINI, signs_calls, to_contents
from service.providers.base import ProviderRequest

# reasoning.effort as Gemini 3's thinking level, and as a thinking budget before it.
EFFORT_LEVELS = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high"}
EFFORT_BUDGETS = {"none": 0, "minimal": 512, "low": 1024, "medium": 8192, "high": 24576}
# Fields of a client's request that concern turnstore (or caching, which Gemini does by
# prefix), never sent: they are honoured, not dropped.
NOT_SENT = frozenset(
    {"metadata", "prompt_cache_key", "prompt_cache_retention", "store", "truncation"}
)
_MAPPED = "temperature top_p max_output_tokens tool_choice parallel_tool_calls reasoning text"
_FIELDS = frozenset({*_MAPPED.split(), "service_tier", *NOT_SENT})


class _Format(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class _Text(msgspec.Struct, forbid_unknown_fields=True):
    format: _Format | None = None
    verbosity: str | None = None


class _Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class _NamedChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class _Tool(msgspec.Struct):
    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _field(fields: Mapping[str, msgspec.Raw], name: str, kind: Any) -> Any:
    """A client's field decoded as ``kind`` (None when absent); a value of another shape is
    the client's error, named by its param."""
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError:
        raise InvalidInput(f"{name} has a value a Gemini model cannot take.", param=name) from None


def _config(fields: Mapping[str, msgspec.Raw], model: str) -> dict[str, Any]:
    """The client's fields as Gemini's ``generationConfig``; a field it cannot honour is
    refused with its param."""
    for name in fields:
        if name not in _FIELDS:
            raise InvalidInput(f"{name} cannot be sent to a Gemini model.", param=name)
    tier: str | None = _field(fields, "service_tier", str | None)
    if tier not in (None, "auto", "default"):
        raise InvalidInput("Gemini models take service_tier auto only.", param="service_tier")
    if _field(fields, "parallel_tool_calls", bool | None) is False:
        raise InvalidInput(
            "Gemini models cannot be kept from calling tools in parallel.",
            param="parallel_tool_calls",
        )
    config: dict[str, Any] = {}
    for name, key in (("temperature", "temperature"), ("top_p", "topP")):
        value: float | None = _field(fields, name, float | None)
        if value is not None:
            config[key] = value
    limit: int | None = _field(fields, "max_output_tokens", int | None)
    if limit is not None:
        if limit < 1:
            raise InvalidInput("max_output_tokens must be at least 1.", param="max_output_tokens")
        config["maxOutputTokens"] = limit
    text: _Text | None = _field(fields, "text", _Text | None)
    if text is not None:
        config |= _format(text)
    reasoning: _Reasoning | None = _field(fields, "reasoning", _Reasoning | None)
    if reasoning is not None:
        thinking = _thinking(reasoning, model)
        if thinking:
            config["thinkingConfig"] = thinking
    return config


def _format(text: _Text) -> dict[str, Any]:
    if text.verbosity not in (None, "medium"):
        raise InvalidInput("Gemini models take text.verbosity medium only.", param="text.verbosity")
    chosen = text.format
    if chosen is None or chosen.type == "text":
        return {}
    if chosen.type == "json_object":
        return {"responseMimeType": "application/json"}
    if chosen.type != "json_schema" or chosen.schema is None:
        raise InvalidInput(
            "Gemini models take text.format text, json_object or json_schema (with its schema).",
            param="text.format",
        )
    return {"responseMimeType": "application/json", "responseJsonSchema": chosen.schema}


def _thinking(reasoning: _Reasoning, model: str) -> dict[str, Any]:
    thinking: dict[str, Any] = {}
    effort = reasoning.effort
    if effort is not None and signs_calls(model):  # Gemini 3: a level; it always thinks
        if effort not in EFFORT_LEVELS:
            raise InvalidInput(
                "Gemini 3 models take reasoning.effort minimal, low, medium or high.",
                param="reasoning.effort",
            )
        thinking["thinkingLevel"] = EFFORT_LEVELS[effort]
    elif effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise InvalidInput(
                "Gemini models take reasoning.effort none, minimal, low, medium or high.",
                param="reasoning.effort",
            )
        thinking["thinkingBudget"] = EFFORT_BUDGETS[effort]
    summary = reasoning.summary or reasoning.generate_summary
    if summary not in (None, "auto", "concise", "detailed"):
        raise InvalidInput(
            "reasoning.summary is auto, concise or detailed.", param="reasoning.summary"
        )
    if summary is not None:  # readable thinking, which Gemini gives only when asked
        thinking["includeThoughts"] = True
    return thinking


def _tool_config(fields: Mapping[str, msgspec.Raw]) -> dict[str, Any] | None:
    chosen: str | _NamedChoice | None = _field(fields, "tool_choice", str | _NamedChoice | None)
    if chosen is None:
        return None
    if isinstance(chosen, _NamedChoice):
        calling = {"mode": "ANY", "allowedFunctionNames": [chosen.name]}
    elif chosen in ("auto", "required", "none"):
        calling = {"mode": {"auto": "AUTO", "required": "ANY", "none": "NONE"}[chosen]}
    else:
        raise InvalidInput(
            "tool_choice must be auto, required, none or a function.", param="tool_choice"
        )
    return {"functionCallingConfig": calling}


def _tools(tools: msgspec.Raw | None) -> list[dict[str, Any]]:
    if tools is None:
        return []
    try:
        listed = msgspec.json.decode(tools, type=list[_Tool])
    except msgspec.DecodeError:
        raise InvalidInput("tools must be a list of tools.", param="tools") from None
    declarations: list[dict[str, Any]] = []
    for tool in listed:
        if tool.type != "function" or not tool.name:
            raise InvalidInput(
                f"A Gemini model takes function tools only, not {tool.type!r}.", param="tools"
            )
        described = {"description": tool.description} if tool.description else {}
        schema = tool.parameters or {"type": "object", "properties": {}}
        declarations.append({"name": tool.name, **described, "parametersJsonSchema": schema})
    return [{"functionDeclarations": declarations}] if declarations else []


def _body(request: ProviderRequest, model: str) -> dict[str, Any]:
    config = _config(request.fields, model)
    conversation = to_contents(for_form(request.input_items, GEMINI), model)
    texts = [text for text in (request.instructions, *conversation.system) if text]
    body: dict[str, Any] = {"contents": conversation.contents}
    if texts:
        body["systemInstruction"] = {"parts": [{"text": text} for text in texts]}
    if tools := _tools(request.tools):
        body["tools"] = tools
    if (choice := _tool_config(request.fields)) is not None:
        body["toolConfig"] = choice
    if config:
        body["generationConfig"] = config
    return body


def generate_body(request: ProviderRequest, model: str) -> bytes:
    """The ``:generateContent`` (or ``:streamGenerateContent``) body of ``request``: Gemini's
    parts spliced as the bytes kept."""
    return msgspec.json.encode(_body(request, model))


def count_body(request: ProviderRequest, model: str) -> bytes:
    """The ``:countTokens`` body: the whole request a create would send, so the system
    instruction and tools are counted too."""
    return msgspec.json.encode(
        {"generateContentRequest": {"model": f"models/{model}"} | _body(request, model)}
    )
