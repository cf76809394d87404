"""The Chat Completions request of a provider request: ``chat_body``.

The conversation comes from ``core/translate/chat_messages.to_chat`` (a Chat server's own assistant
messages spliced as the bytes kept, other providers' own items as the Responses items they
read as), with the instructions and system messages as one leading ``system`` message (chat
templates want it first). The client's fields (read once: request_fields.py) are mapped or
refused with their param, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import for_form
from service.core.translate.chat_messages import CHAT, to_chat
from service.providers.base import ProviderRequest
from service.providers.request_fields import Fields, Format, NamedChoice, function_tools

# reasoning.effort as Chat's reasoning_effort (vLLM, Ollama, OpenRouter, DeepSeek take it).
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high"})
MODELS = "Chat Completions models"  # as messages name the target


def _fields(fields: Mapping[str, msgspec.Raw]) -> dict[str, Any]:
    """The client's fields as Chat's; one it cannot honour is refused with its param."""
    asked = Fields.read(fields, MODELS)
    out: dict[str, Any] = {}
    for name, value in (("temperature", asked.temperature), ("top_p", asked.top_p)):
        if value is not None:
            out[name] = value
    if asked.max_output_tokens is not None:
        out["max_tokens"] = asked.max_output_tokens  # every server takes it (not all the newer)
    if isinstance(asked.tool_choice, NamedChoice):
        out["tool_choice"] = {"type": "function", "function": {"name": asked.tool_choice.name}}
    elif asked.tool_choice is not None:
        out["tool_choice"] = asked.tool_choice
    if asked.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = asked.parallel_tool_calls
    reasoning = asked.reasoning
    if reasoning is not None and reasoning.effort is not None:
        if reasoning.effort not in EFFORTS:
            raise InvalidInput(
                f"{MODELS} take reasoning.effort {', '.join(sorted(EFFORTS))}.",
                param="reasoning.effort",
            )
        out["reasoning_effort"] = reasoning.effort
    if asked.text is not None and asked.text.verbosity is not None:
        raise InvalidInput(f"{MODELS} take no text.verbosity.", param="text")
    if asked.text is not None and asked.text.format is not None:
        out |= _response_format(asked.text.format)
    if asked.user:
        out["user"] = asked.user
    return out


def _response_format(fmt: Format) -> dict[str, Any]:
    if fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.type != "json_schema" or fmt.schema is None or not fmt.name:
        raise InvalidInput(
            "Chat Completions models take text.format text, json_object or json_schema "
            "(with its name and schema).",
            param="text.format",
        )
    schema: dict[str, Any] = {"name": fmt.name}
    if fmt.description is not None:
        schema["description"] = fmt.description
    schema["schema"] = fmt.schema
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _tools(tools: msgspec.Raw | None) -> list[dict[str, Any]]:
    out = []
    for tool in function_tools(tools, MODELS):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.schema
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def chat_body(request: ProviderRequest, model: str, *, stream: bool) -> bytes:
    """The ``POST {base}/chat/completions`` body of ``request``: its model, messages (Chat's
    own spliced as the bytes kept), stream with usage, tools and the client's fields mapped."""
    fields = _fields(request.fields)
    conversation = to_chat(for_form(request.input_items, CHAT, request.plain))
    texts = [text for text in (request.instructions, *conversation.system) if text]
    system = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    body: dict[str, Any] = {"model": model, "messages": [*system, *conversation.messages]}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tools := _tools(request.tools):
        body["tools"] = tools
    body.update(fields)
    return msgspec.json.encode(body)
