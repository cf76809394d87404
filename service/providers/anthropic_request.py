"""The Messages API request of a provider request: ``messages_body`` (and ``count_body``).

The conversation comes from ``core/translate/anthropic_blocks.to_messages`` (Anthropic's own blocks
spliced byte for byte, other providers' own items as the Responses items they read as); the
client's fields are mapped to the Messages API's or refused with their param, never dropped.
Prompt caching: breakpoints on the system prompt's last block, on the end of the replayed
history and on the request's last block, each on a block built here (never on a thinking
block, never by re-serialising a block kept verbatim), so each request reads back what the
one before it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import for_form
from service.core.translate.anthropic_blocks import ANTHROPIC, OPAQUE_BLOCKS, to_messages
from service.providers.base import ProviderRequest
from service.providers.request_fields import Fields, NamedChoice, function_tools

EPHEMERAL = {"type": "ephemeral"}
MAX_BREAKPOINTS = 4  # the API refuses a fifth cache_control
# reasoning.effort as a thinking budget (clamped below max_tokens; the API's floor is 1024).
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}
MIN_BUDGET = 1024
MODELS = "Anthropic models"  # as messages name the target


def _fields(fields: Mapping[str, msgspec.Raw], default_max_tokens: int) -> dict[str, Any]:
    """The client's fields as the Messages API's (``max_tokens`` always; ``thinking`` when
    ``reasoning.effort`` asks for it); a field it cannot honour is refused with its param."""
    asked = Fields.read(fields, MODELS)
    out: dict[str, Any] = {"max_tokens": asked.max_output_tokens or default_max_tokens}
    for name, value in (("temperature", asked.temperature), ("top_p", asked.top_p)):
        if value is not None:
            out[name] = value
    choice = _tool_choice(asked)
    if choice is not None:
        out["tool_choice"] = choice
    if asked.reasoning is not None and asked.reasoning.effort not in (None, "none"):
        out["thinking"] = _thinking(asked.reasoning.effort, out)
    text = asked.text
    if text is not None and text.verbosity is not None:
        raise InvalidInput(f"{MODELS} take no text.verbosity.", param="text")
    if text is not None and text.format is not None and text.format.type != "text":
        if text.format.type != "json_schema" or text.format.schema is None:
            raise InvalidInput(
                f"{MODELS} take text.format json_schema (with its schema) only.",
                param="text.format",
            )
        out["output_config"] = {"format": {"type": "json_schema", "schema": text.format.schema}}
    if asked.user:
        out["metadata"] = {"user_id": asked.user}
    return out


def _tool_choice(asked: Fields) -> dict[str, Any] | None:
    chosen, parallel = asked.tool_choice, asked.parallel_tool_calls
    choice: dict[str, Any] | None
    if isinstance(chosen, NamedChoice):
        choice = {"type": "tool", "name": chosen.name}
    elif chosen is None:
        choice = {"type": "auto"} if parallel is False else None
    else:
        choice = {"type": {"auto": "auto", "required": "any", "none": "none"}[chosen]}
    if parallel is False and choice is not None and choice["type"] != "none":
        choice["disable_parallel_tool_use"] = True
    return choice


def _thinking(effort: str, body: dict[str, Any]) -> dict[str, Any]:
    if effort not in EFFORT_BUDGETS:
        raise InvalidInput(
            "Anthropic models take reasoning.effort low, medium or high.", param="reasoning.effort"
        )
    budget = min(EFFORT_BUDGETS[effort], body["max_tokens"] - 1)
    if budget < MIN_BUDGET:
        raise InvalidInput(
            f"Thinking needs max_output_tokens above {MIN_BUDGET}.", param="max_output_tokens"
        )
    if body.get("temperature", 1) != 1:
        raise InvalidInput("With reasoning, temperature may only be 1.", param="temperature")
    if body.get("top_p", 1) < 0.95:
        raise InvalidInput("With reasoning, top_p may not be below 0.95.", param="top_p")
    if body.get("tool_choice", {}).get("type", "auto") not in ("auto", "none"):
        raise InvalidInput("With reasoning, tool_choice may be auto or none.", param="tool_choice")
    return {"type": "enabled", "budget_tokens": budget}


def _tools(tools: msgspec.Raw | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for tool in function_tools(tools, MODELS):
        described = {"description": tool.description} if tool.description else {}
        out.append({"name": tool.name, **described, "input_schema": tool.schema})
    return out


class _Head(msgspec.Struct):
    type: str = ""


def _kind(block: Any) -> str | None:
    if isinstance(block, msgspec.Raw):
        return msgspec.json.decode(block, type=_Head).type
    return block.get("type") if isinstance(block, dict) else None


def _answers_another(messages: list[dict[str, Any]]) -> bool:
    """Whether the final assistant message holds a tool_use but does not start with thinking:
    a turn another provider (or Anthropic without thinking) answered."""
    final = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    if final is None or not final["content"]:
        return False
    kinds = [_kind(block) for block in final["content"]]
    return "tool_use" in kinds and kinds[0] not in OPAQUE_BLOCKS


def _mark(messages: list[dict[str, Any]]) -> int:
    """Cache breakpoints on the request's last block and on the end of the replayed history
    (the last block before the newest user message): each on the nearest block at or before
    it that was built here. A block kept verbatim is never marked: adding a field would mean
    re-serialising what must go byte for byte (and thinking may not carry one at all).
    Returns how many were placed."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    ends = [len(messages) - 1] + ([users[-1] - 1] if users and users[-1] > 0 else [])
    placed = 0
    for end in ends:
        block = _built_at_or_before(messages, end)
        if block is not None and "cache_control" not in block:
            block["cache_control"] = dict(EPHEMERAL)
            placed += 1
    return placed


def _built_at_or_before(messages: list[dict[str, Any]], end: int) -> dict[str, Any] | None:
    for message in reversed(messages[: end + 1]):
        for block in reversed(message["content"]):
            if isinstance(block, dict) and block.get("type") not in OPAQUE_BLOCKS:
                return block
    return None


def _body(request: ProviderRequest, model: str, *, max_tokens: int) -> dict[str, Any]:
    fields = _fields(request.fields, max_tokens)
    conversation = to_messages(for_form(request.input_items, ANTHROPIC, request.plain))
    texts = [request.instructions, *conversation.system]
    system: list[dict[str, Any]] = [{"type": "text", "text": t} for t in texts if t]
    if system:
        system[-1]["cache_control"] = dict(EPHEMERAL)
    if "thinking" in fields and _answers_another(conversation.messages):
        # With thinking on, the API refuses a final assistant tool_use turn that does not
        # start with a thinking block: this one was answered without (by another provider,
        # or by Anthropic without thinking). It is sent without thinking.
        del fields["thinking"]
    if _mark(conversation.messages) + bool(system) > MAX_BREAKPOINTS:  # never: 3 at most
        raise AssertionError("more cache breakpoints than the API takes")
    body: dict[str, Any] = {"model": model, "max_tokens": fields.pop("max_tokens")}
    if system:
        body["system"] = system
    body["messages"] = conversation.messages
    if tools := _tools(request.tools):
        body["tools"] = tools
    body.update(fields)
    return body


def messages_body(request: ProviderRequest, model: str, *, max_tokens: int, stream: bool) -> bytes:
    """The ``POST /v1/messages`` body of ``request`` (``max_tokens``: unless the client's
    ``max_output_tokens`` says otherwise). Anthropic's blocks are spliced as the bytes kept."""
    body = _body(request, model, max_tokens=max_tokens)
    if stream:
        body["stream"] = True
    return msgspec.json.encode(body)


def count_body(request: ProviderRequest, model: str, *, max_tokens: int) -> bytes:
    """The ``POST /v1/messages/count_tokens`` body: a create's, less what only a create takes."""
    body = _body(request, model, max_tokens=max_tokens)
    del body["max_tokens"]
    return msgspec.json.encode(body)
