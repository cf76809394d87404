"""Chat Completions assistant messages: the form a Chat turn is kept in, and a request's items
as a Chat server takes them.

A turn a Chat Completions server (vLLM, Ollama, llama.cpp, SGLang, OpenRouter...) answered
keeps each assistant message as the server sent it, one replay item a message: ``role``,
``content``, its thinking as ``reasoning_content`` or ``reasoning`` (whichever the server
used), ``tool_calls``, and whatever else the server put there (``refusal: null``...). It goes
back verbatim to the origin that made it.

A Chat message is told from a Responses item by its first bytes: the adapter keeps it with
``role`` first (service/providers/chat_completions.py), and only such a message with what
Chat alone has (``tool_calls``, thinking, ``refusal``..., or no text) is one: an assistant
message of the Responses API's short form (``role`` and ``content`` alone) reads the same
either way.

- ``CHAT``: the form (form.Form) the rest of turnstore reads messages by. Unlike a block or a
  part, one message is shown as several Responses items, each under an id of its own: its
  thinking as a ``reasoning`` item (``summary_text``; it stands for the whole message, so a
  client's reference to it, or its sealed value, brings the message back byte for byte), then
  its text as an assistant ``message``, then each tool call as a ``function_call`` with the
  server's call id. A message with thinking is opaque: another origin gets its text and calls.
- ``to_chat``: a request's items as Chat's ``messages``. Chat's own messages go verbatim
  (spliced as the bytes kept); everything else (another provider's own items were made
  Responses items before, translate/__init__.py ``for_form``) is translated: system and
  developer messages into one leading system text, a ``function_call`` into its assistant
  message's ``tool_calls`` and its output into a ``tool`` message with the same id, images as
  ``image_url`` parts; reasoning and compaction items of other providers are left out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import form

START = b'{"role":"assistant"'
THINKING_FIELDS = ("reasoning_content", "reasoning")  # vLLM and DeepSeek; Ollama, OpenRouter
# What only a Chat assistant message carries (the Responses API's short form has role and
# content alone; its items have a type).
_CHAT_ONLY = (
    "tool_calls",
    "reasoning_content",
    "reasoning",
    "refusal",
    "function_call",
    "audio",
    "annotations",
)


class _Head(msgspec.Struct):
    type: str | None = None
    content: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    tool_calls: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    reasoning: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    refusal: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    function_call: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    audio: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    annotations: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class Function(msgspec.Struct):
    name: str = ""
    arguments: str = ""


class ToolCall(msgspec.Struct):
    id: str | None = None
    type: str = "function"
    function: Function = msgspec.field(default_factory=Function)


class ChatMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def thinking(self) -> str:
        return self.reasoning_content or self.reasoning or ""

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def is_chat(item: msgspec.Raw | bytes) -> bool:
    """A Chat Completions assistant message (kept as its server sent it), not a Responses
    item: cheap for the items that are not (their first bytes tell)."""
    if memoryview(item)[: len(START)].tobytes() != START:
        return False
    head = msgspec.json.decode(item, type=_Head)
    if head.type is not None:
        return False
    if head.content is msgspec.UNSET or bytes(head.content) == b"null":
        return True
    return any(getattr(head, name) is not msgspec.UNSET for name in _CHAT_ONLY)


def message(raw: msgspec.Raw) -> ChatMessage:
    return msgspec.json.decode(raw, type=ChatMessage)


def reasoning_id(thinking: str) -> str:
    """The id a message's thinking is shown by (a prefix and 48 hex digits, as OpenAI's): a
    digest of its text, which a stream knows as soon as the thinking ends."""
    digest = hashlib.sha256(b"turnstore chat reasoning\0" + thinking.encode()).hexdigest()
    return f"rs_{digest[:48]}"


def call_item_id(call_id: str) -> str:
    """The id a tool call is shown by as a ``function_call`` item (its ``call_id`` is the
    server's own)."""
    digest = hashlib.sha256(b"turnstore chat call\0" + call_id.encode()).hexdigest()
    return f"fc_{digest[:48]}"


def _message_item(read: ChatMessage) -> dict[str, Any] | None:
    parts: list[dict[str, Any]] = []
    if read.text:
        parts.append({"type": "output_text", "text": read.text, "annotations": []})
    if read.refusal:
        parts.append({"type": "refusal", "refusal": read.refusal})
    if not parts:
        return None
    return {"type": "message", "role": "assistant", "content": parts}


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call.id or "",
        "name": call.function.name,
        "arguments": call.function.arguments,
    }


class _Chat:
    """Chat Completions assistant messages as the rest of turnstore reads them (form.Form): one
    message, several Responses items."""

    name = "chat"
    starts: tuple[bytes, ...] = (START,)

    def owns(self, item: msgspec.Raw) -> bool:
        return is_chat(item)

    def opaque(self, item: msgspec.Raw) -> bool:
        return bool(message(item).thinking)  # the issuer's alone; its text and calls are not

    def shown(self, item: msgspec.Raw) -> list[form.Shown]:
        read = message(item)
        out: list[form.Shown] = []
        if read.thinking:
            own = reasoning_id(read.thinking)
            summary = [{"type": "summary_text", "text": read.thinking}]
            out.append(form.Shown({"type": "reasoning", "summary": summary}, own, own, whole=True))
        text = _message_item(read)
        if text is not None:  # known by its place in its turn
            out.append(form.Shown(text, form.provider_id("message", item), None))
        for call in read.tool_calls or ():
            own = call_item_id(call.id or "")
            out.append(form.Shown(_call_item(call), own, own, call.id))
        return out

    def calls(self, item: msgspec.Raw) -> list[form.FunctionCall]:
        calls = message(item).tool_calls or ()
        return [form.FunctionCall(c.id or "", c.function.name, c.function.arguments) for c in calls]


CHAT = _Chat()


# -- a request's items as Chat's messages ----------------------------------------------------


@dataclass
class Messages:
    """A request's conversation as Chat takes it."""

    system: list[str] = field(default_factory=list)  # system and developer messages' texts
    messages: list[Any] = field(default_factory=list)  # dicts built here, or Raw kept verbatim


def to_chat(items: Sequence[msgspec.Raw]) -> Messages:
    """``items`` (Chat's messages and Responses items) as Chat's messages."""
    out = Messages()
    issued: set[str] = set()  # the calls the request holds: a tool message names one of them
    for item in items:
        if is_chat(item):
            out.messages.append(item)  # verbatim: the server's own message
            issued.update(call.call_id for call in CHAT.calls(item))
            continue
        read = form.read_item(item, "a Chat Completions model")
        if isinstance(read, form.Message):
            _message(out, read)
        elif isinstance(read, form.CallItem):
            _call(out, read)
            issued.add(read.call_id)
        elif isinstance(read, form.Output):
            output = form.text_of(read.output)
            if read.call_id in issued:
                tool = {"role": "tool", "tool_call_id": read.call_id, "content": output}
                out.messages.append(tool)
            else:  # its call left the window: its output as text
                said = f"[output of call {read.call_id}]\n{output}"
                out.messages.append({"role": "user", "content": said})
    return out


def _call(out: Messages, call: form.CallItem) -> None:
    """A call as an entry of its assistant message's ``tool_calls``."""
    entry = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    last = out.messages[-1] if out.messages else None
    if isinstance(last, dict) and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(entry)
    else:
        out.messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})


def _message(out: Messages, read: form.Message) -> None:
    if read.role in ("system", "developer"):
        out.system.append(form.text_of(read.content))
        return
    if read.role not in ("user", "assistant"):
        raise InvalidInput(f"A message of role {read.role!r} is not supported.", param="input")
    content = read.content if isinstance(read.content, str) else _parts(read.content or [])
    if content:
        out.messages.append({"role": read.role, "content": content})


def _text(text: Any) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(part: dict[str, Any]) -> dict[str, Any] | None:
    if part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return None


def _parts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Responses content parts as Chat's: text alone as a string (what every server takes),
    else text and ``image_url`` parts; files cannot go (no Chat server reads them)."""
    out = form.content_parts(parts, "a Chat Completions model", _text, _image)
    if all(part["type"] == "text" for part in out):
        return "".join(part["text"] for part in out)
    return out
