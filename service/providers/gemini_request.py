"""The Gemini API request of a provider request: ``generate_body`` (and ``count_body``).

The conversation comes from ``core/translate/gemini_parts.to_contents`` (Gemini's own parts spliced
byte for byte, other providers' own items as the Responses items they read as). The client's
fields (read once: request_fields.py) are mapped to Gemini's or refused with their param,
never dropped: ``temperature``,
``top_p``, ``max_output_tokens`` into ``generationConfig``, ``text.format`` as
``responseJsonSchema`` (with ``responseMimeType``), ``reasoning.effort`` as ``thinkingConfig``
(a thinking level on Gemini 3, a budget before it), ``reasoning.summary`` as
``includeThoughts``, ``tool_choice`` as ``toolConfig``. Gemini caches by prefix: nothing here
depends on anything but the request, so the request of turn N+1 begins with turn N's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import for_form
from service.core.translate.gemini_parts import GEMINI, signs_calls, to_contents
from service.providers.base import ProviderRequest
from service.providers.request_fields import Fields, NamedChoice, Reasoning, Text, function_tools

# reasoning.effort as Gemini 3's thinking level, and as a thinking budget before it.
EFFORT_LEVELS = {"minimal": "minimal", "low": "low", "medium": "medium", "high": "high"}
EFFORT_BUDGETS = {"none": 0, "minimal": 512, "low": 1024, "medium": 8192, "high": 24576}
MODELS = "Gemini models"  # as messages name the target


def _config(asked: Fields, model: str) -> dict[str, Any]:
    """The client's fields as Gemini's ``generationConfig``; a field it cannot honour is
    refused with its param."""
    if asked.parallel_tool_calls is False:
        raise InvalidInput(
            f"{MODELS} cannot be kept from calling tools in parallel.",
            param="parallel_tool_calls",
        )
    config: dict[str, Any] = {}
    for key, value in (("temperature", asked.temperature), ("topP", asked.top_p)):
        if value is not None:
            config[key] = value
    if asked.max_output_tokens is not None:
        config["maxOutputTokens"] = asked.max_output_tokens
    if asked.text is not None:
        config |= _format(asked.text)
    if asked.reasoning is not None:
        thinking = _thinking(asked.reasoning, model)
        if thinking:
            config["thinkingConfig"] = thinking
    return config


def _user(fields: Mapping[str, msgspec.Raw], asked: Fields) -> None:
    """Gemini has no field for the end user: one asked is refused, never dropped."""
    if asked.user:
        param = "safety_identifier" if "safety_identifier" in fields else "user"
        raise InvalidInput(f"{param} cannot be sent to {MODELS}.", param=param)


def _format(text: Text) -> dict[str, Any]:
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


def _thinking(reasoning: Reasoning, model: str) -> dict[str, Any]:
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


def _tool_config(asked: Fields) -> dict[str, Any] | None:
    chosen = asked.tool_choice
    if chosen is None:
        return None
    if isinstance(chosen, NamedChoice):
        calling = {"mode": "ANY", "allowedFunctionNames": [chosen.name]}
    else:
        calling = {"mode": {"auto": "AUTO", "required": "ANY", "none": "NONE"}[chosen]}
    return {"functionCallingConfig": calling}


def _tools(tools: msgspec.Raw | None) -> list[dict[str, Any]]:
    declarations: list[dict[str, Any]] = []
    for tool in function_tools(tools, MODELS):
        described = {"description": tool.description} if tool.description else {}
        declarations.append({"name": tool.name, **described, "parametersJsonSchema": tool.schema})
    return [{"functionDeclarations": declarations}] if declarations else []


def _body(request: ProviderRequest, model: str) -> dict[str, Any]:
    asked = Fields.read(request.fields, MODELS)
    _user(request.fields, asked)
    config = _config(asked, model)
    conversation = to_contents(for_form(request.input_items, GEMINI, request.plain), model)
    texts = [text for text in (request.instructions, *conversation.system) if text]
    body: dict[str, Any] = {"contents": conversation.contents}
    if texts:
        body["systemInstruction"] = {"parts": [{"text": text} for text in texts]}
    if tools := _tools(request.tools):
        body["tools"] = tools
    if (choice := _tool_config(asked)) is not None:
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
