"""The Chat Completions request of a provider request: ``chat_body``.

The conversation: a Chat server's own assistant messages go verbatim (spliced as the bytes
kept, service/core/translate_chat.py), and so does one a stateless client brings back inside
its reasoning item's sealed value (the text and calls it was also shown as, which follow it,
are then not sent twice). Everything else is read as Responses items (another provider's
blocks and parts through ``to_items``) and translated: system and developer messages and the
instructions into one leading ``system`` message (chat templates want it first), a
``function_call`` into its assistant message's ``tool_calls`` and its output into a ``tool``
message with the same id, images as ``image_url`` parts; reasoning and compaction items of
other providers are left out. The client's fields are mapped or refused with their param,
never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import to_items
from service.core.translate_chat import is_chat, message, restored
from service.providers.base import ProviderRequest

# Fields of a client's request that concern turnstore, never sent: honoured, not dropped.
NOT_SENT = frozenset(
    {"metadata", "prompt_cache_key", "prompt_cache_retention", "store", "truncation"}
)
# reasoning.effort as Chat's reasoning_effort (vLLM, Ollama, OpenRouter, DeepSeek take it).
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high"})
_MAPPED = "temperature top_p max_output_tokens tool_choice parallel_tool_calls reasoning text"
_FIELDS = frozenset({*_MAPPED.split(), "user", "safety_identifier", "service_tier", *NOT_SENT})


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
    # The thinking a Chat server returns is readable whenever it thinks: a summary asks nothing.
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


class _Head(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    encrypted_content: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = ""


class _Call(msgspec.Struct):
    call_id: str
    name: str
    arguments: str = "{}"


class _Output(msgspec.Struct):
    call_id: str
    output: str | list[dict[str, Any]] = ""


def _field(fields: Mapping[str, msgspec.Raw], name: str, kind: Any) -> Any:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError:
        raise InvalidInput(
            f"{name} has a value a Chat Completions model cannot take.", param=name
        ) from None


def _fields(fields: Mapping[str, msgspec.Raw]) -> dict[str, Any]:
    """The client's fields as Chat's; one it cannot honour is refused with its param."""
    for name in fields:
        if name not in _FIELDS:
            raise InvalidInput(f"{name} cannot be sent to a Chat Completions model.", param=name)
    tier: str | None = _field(fields, "service_tier", str | None)
    if tier not in (None, "auto", "default"):
        raise InvalidInput(
            "Chat Completions models take service_tier auto only.", param="service_tier"
        )
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        value: float | None = _field(fields, name, float | None)
        if value is not None:
            out[name] = value
    limit: int | None = _field(fields, "max_output_tokens", int | None)
    if limit is not None:
        if limit < 1:
            raise InvalidInput("max_output_tokens must be at least 1.", param="max_output_tokens")
        out["max_tokens"] = limit  # what every Chat server takes (max_completion_tokens: not all)
    choice = _tool_choice(fields)
    if choice is not None:
        out["tool_choice"] = choice
    parallel: bool | None = _field(fields, "parallel_tool_calls", bool | None)
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    reasoning: _Reasoning | None = _field(fields, "reasoning", _Reasoning | None)
    if reasoning is not None and reasoning.effort is not None:
        if reasoning.effort not in EFFORTS:
            raise InvalidInput(
                f"Chat Completions models take reasoning.effort {', '.join(sorted(EFFORTS))}.",
                param="reasoning.effort",
            )
        out["reasoning_effort"] = reasoning.effort
    text: _Text | None = _field(fields, "text", _Text | None)
    if text is not None and text.verbosity is not None:
        raise InvalidInput("Chat Completions models take no text.verbosity.", param="text")
    if text is not None and text.format is not None:
        out |= _response_format(text.format)
    user = _field(fields, "safety_identifier", str | None) or _field(fields, "user", str | None)
    if user:
        out["user"] = user
    return out


def _response_format(fmt: _Format) -> dict[str, Any]:
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


def _tool_choice(fields: Mapping[str, msgspec.Raw]) -> Any:
    chosen: str | _NamedChoice | None = _field(fields, "tool_choice", str | _NamedChoice | None)
    if isinstance(chosen, _NamedChoice):
        return {"type": "function", "function": {"name": chosen.name}}
    if chosen in (None, "auto", "required", "none"):
        return chosen
    raise InvalidInput(
        "tool_choice must be auto, required, none or a function.", param="tool_choice"
    )


def _tools(tools: msgspec.Raw | None) -> list[dict[str, Any]]:
    if tools is None:
        return []
    try:
        listed = msgspec.json.decode(tools, type=list[_Tool])
    except msgspec.DecodeError:
        raise InvalidInput("tools must be a list of tools.", param="tools") from None
    out = []
    for tool in listed:
        if tool.type != "function" or not tool.name:
            raise InvalidInput(
                f"A Chat Completions model takes function tools only, not {tool.type!r}.",
                param="tools",
            )
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


@dataclass
class Messages:
    """A request's conversation as Chat takes it."""

    system: list[str] = field(default_factory=list)
    messages: list[Any] = field(default_factory=list)  # dicts built here, or Raw kept verbatim
    # What the last message kept verbatim was also shown as (its text, its call ids): items a
    # stateless client sent back after it, not sent twice.
    _covered: tuple[str, set[str]] | None = None

    def add(self, item: msgspec.Raw) -> None:
        if is_chat(item):
            self._verbatim(item)
            return
        head = msgspec.json.decode(item, type=_Head)
        kept = restored(head.encrypted_content) if head.type == "reasoning" else None
        if kept is not None:
            self._verbatim(kept)
        elif head.type in ("reasoning", "compaction"):
            return  # another provider's: readable by its issuer alone
        elif not self._is_covered(item, head):
            self._covered = None
            for neutral in to_items([item]):  # another provider's blocks and parts
                self._translated(neutral)

    def _verbatim(self, raw: msgspec.Raw) -> None:
        read = message(raw)
        self.messages.append(raw)
        self._covered = (read.text, {call.id or "" for call in read.tool_calls or ()})

    def _is_covered(self, item: msgspec.Raw, head: _Head) -> bool:
        if self._covered is None:
            return False
        text, calls = self._covered
        if head.type == "function_call":
            return msgspec.json.decode(item, type=_Call).call_id in calls
        if head.type in (None, "message") and head.role == "assistant":
            return _text(msgspec.json.decode(item, type=_Message).content) == text
        return False

    def _translated(self, item: msgspec.Raw) -> None:
        head = msgspec.json.decode(item, type=_Head)
        if head.type in (None, "message") and head.role is not None:
            self._message(msgspec.json.decode(item, type=_Message))
        elif head.type == "function_call":
            call = msgspec.json.decode(item, type=_Call)
            entry = {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            last = self.messages[-1] if self.messages else None
            if isinstance(last, dict) and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(entry)
            else:
                self.messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
        elif head.type == "function_call_output":
            result = msgspec.json.decode(item, type=_Output)
            output = result.output if isinstance(result.output, str) else _text(result.output)
            self.messages.append(
                {"role": "tool", "tool_call_id": result.call_id, "content": output}
            )
        elif head.type in ("reasoning", "compaction"):
            return
        else:
            raise InvalidInput(
                f"An item of type {head.type!r} cannot be sent to a Chat Completions model.",
                param="input",
            )

    def _message(self, read: _Message) -> None:
        if read.role in ("system", "developer"):
            self.system.append(_text(read.content))
            return
        if read.role not in ("user", "assistant"):
            raise InvalidInput(f"A message of role {read.role!r} is not supported.", param="input")
        content = read.content if isinstance(read.content, str) else _parts(read.content or [])
        if content:
            self.messages.append({"role": read.role, "content": content})


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        str(p.get("text") or p.get("refusal") or "") for p in content or () if isinstance(p, dict)
    )


def _parts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Responses content parts as Chat's: text alone as a string (what every server takes),
    else text and ``image_url`` parts; files cannot go (no Chat server reads them)."""
    out: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text") and part.get("text"):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and part.get("refusal"):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind not in ("input_text", "output_text", "text", "refusal"):
            raise InvalidInput(
                f"A content part of type {kind!r} cannot be sent to a Chat Completions model.",
                param="input",
            )
    if all(part["type"] == "text" for part in out):
        return "".join(part["text"] for part in out)
    return out


def chat_body(request: ProviderRequest, model: str, *, stream: bool) -> bytes:
    """The ``POST {base}/chat/completions`` body of ``request``: its model, messages (Chat's
    own spliced as the bytes kept), stream with usage, tools and the client's fields mapped."""
    fields = _fields(request.fields)
    conversation = Messages()
    for item in request.input_items:
        conversation.add(item)
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
