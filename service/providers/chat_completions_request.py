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
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import to_items
from service.core.translate_chat import is_chat, message, restored
from service.providers.base import ProviderRequest
from service.providers.request_fields import Fields, Format, NamedChoice, function_tools

# reasoning.effort as Chat's reasoning_effort (vLLM, Ollama, OpenRouter, DeepSeek take it).
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high"})
MODELS = "Chat Completions models"  # as messages name the target


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
