"""Chat Completions assistant messages, and the Responses items they read as.

A turn a Chat Completions server (vLLM, Ollama, llama.cpp, SGLang, OpenRouter...) answered
keeps each assistant message as the server sent it, one replay item a message: ``role``,
``content``, its thinking as ``reasoning_content`` or ``reasoning`` (whichever the server
used), ``tool_calls``, and whatever else the server put there (``refusal: null``...). It goes
back verbatim to the origin that made it; everywhere else it reads as Responses items:

- ``readable``: what another provider may read of it (its text as an assistant ``message``,
  each tool call as a ``function_call`` with the server's call id); its thinking is the
  issuer's alone (``without_reasoning``: the message as another Chat origin gets it).
- ``shown``: what the OpenAI surface shows of it, each part with the id it is known by: the
  thinking as a ``reasoning`` item (``summary_text``; its ``encrypted_content``, when given,
  holds the whole message, so a client that sends it back brings the message back byte for
  byte: ``restored``), then the text, then the calls.

A Chat message is told from a Responses item by its first bytes: the adapter keeps it with
``role`` first (service/providers/chat_completions.py), and only such a message with what
Chat alone has (``tool_calls``, thinking, ``refusal``..., or no text) is one: an assistant
message of the Responses API's short form (``role`` and ``content`` alone) reads the same
either way.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

START = b'{"role":"assistant"'
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
THINKING_FIELDS = ("reasoning_content", "reasoning")  # vLLM and DeepSeek; Ollama, OpenRouter


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


def readable(raw: msgspec.Raw) -> list[dict[str, Any]]:
    """What another provider may read of a Chat message: its text, its tool calls (Responses
    items, without ids); never its thinking."""
    read = message(raw)
    text = _message_item(read)
    return [*([text] if text else []), *(_call_item(c) for c in read.tool_calls or ())]


Shown = tuple[str | None, str | None, str, dict[str, Any]]  # own id, call id, type, item


def shown(raw: msgspec.Raw, sealed: str | None = None) -> list[Shown]:
    """Every part of a Chat message as the OpenAI surface shows it, with the id each is known
    by (None: the text, known by the message's place in its turn), its call id and its type.
    ``sealed``: the thinking's ``encrypted_content`` (the message itself, sealed or not: it
    brings the message back whole); left out without."""
    read = message(raw)
    out: list[Shown] = []
    if read.thinking:
        own = reasoning_id(read.thinking)
        summary = [{"type": "summary_text", "text": read.thinking}]
        item: dict[str, Any] = {"type": "reasoning", "id": own, "summary": summary}
        if sealed is not None:
            item["encrypted_content"] = sealed
        out.append((own, None, "reasoning", item))
    text = _message_item(read)
    if text is not None:
        out.append((None, None, "message", text))
    for call in read.tool_calls or ():
        own = call_item_id(call.id or "")
        out.append((own, call.id, "function_call", {**_call_item(call), "id": own}))
    return out


def without_reasoning(raw: msgspec.Raw) -> msgspec.Raw:
    """A Chat message as another Chat origin gets it: without its issuer's thinking (the
    message as it is when it has none)."""
    decoded = msgspec.json.decode(raw)
    if not any(name in decoded for name in THINKING_FIELDS):
        return raw
    return msgspec.Raw(
        msgspec.json.encode({k: v for k, v in decoded.items() if k not in THINKING_FIELDS})
    )


def restored(encrypted_content: str | None) -> msgspec.Raw | None:
    """The Chat message a reasoning item's opened ``encrypted_content`` holds (``shown`` put it
    there whole), or None: another provider's reasoning."""
    if not encrypted_content or not encrypted_content.startswith(START.decode()):
        return None
    raw = msgspec.Raw(encrypted_content.encode())
    try:
        return raw if is_chat(raw) else None
    except msgspec.DecodeError:
        return None


def for_another(item: msgspec.Raw) -> msgspec.Raw:
    """An item as a turn of another origin sends it: a Chat message without its thinking,
    anything else as it is."""
    return without_reasoning(item) if is_chat(item) else item
