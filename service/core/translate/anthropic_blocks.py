"""Responses items and Anthropic content blocks: one translation each way.

A conversation's replay items are kept in the form of the provider that made them: the
Responses API's items (``message``, ``function_call``, ``function_call_output``, ``reasoning``)
and, for a turn Anthropic answered, the assistant's content blocks exactly as Anthropic sent
them, one item a block (``thinking`` with its ``signature``, ``redacted_thinking``, ``text``,
``tool_use``). The user's input is always a Responses ``message`` (turnstore writes it).

- ``to_messages``: the items a request carries, as the Messages API takes them. Anthropic's
  blocks go as they are (bytes untouched), consecutive blocks into one assistant message;
  everything else is translated (a ``function_call`` and its output become a ``tool_use``
  and a ``tool_result`` of the same id, the result first in the next user message); system
  and developer messages join the system prompt. Opaque items of another provider never get
  here (the window leaves them out: window.py).
- ``ANTHROPIC``: the form (service/core/translate/form.py) the rest of turnstore reads
  Anthropic's blocks by: a ``tool_use`` is a call, thinking is opaque, and to any other
  provider text is an assistant message and a ``tool_use`` a ``function_call`` (thinking
  left out, as it is readable by its issuer alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import form

# The block types of an Anthropic assistant message that turnstore keeps (and replays).
BLOCK_TYPES = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})
OPAQUE_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # readable by their issuer alone


class _Block(msgspec.Struct):
    type: str
    text: str = ""
    thinking: str = ""
    id: str = ""
    name: str = ""
    input: Any = None


# Anthropic writes a block's ``type`` first, and turnstore rebuilds a streamed block so: what
# does not begin so is no block, told from its first bytes (a window may hold hundreds of KiB
# of items, which a decode would scan whole on every request).
_STARTS = tuple(b'{"type":"' + kind.encode() + b'"' for kind in sorted(BLOCK_TYPES))


def is_block(item: msgspec.Raw) -> bool:
    """An Anthropic content block (kept as Anthropic sent it), not a Responses item."""
    if not memoryview(item)[:32].tobytes().startswith(_STARTS):
        return False
    head = msgspec.json.decode(item, type=form.ItemHead)
    return head.role is None and head.type in BLOCK_TYPES


@dataclass
class Messages:
    """A request's conversation as the Messages API takes it."""

    system: list[str] = field(default_factory=list)  # system and developer messages' texts
    messages: list[dict[str, Any]] = field(default_factory=list)

    def add(self, role: str, *blocks: Any) -> None:
        """Blocks of ``role``, appended to the last message when it is that role's (the API
        merges consecutive same-role messages; a request sends them merged)."""
        if self.messages and self.messages[-1]["role"] == role:
            self.messages[-1]["content"].extend(blocks)
        else:
            self.messages.append({"role": role, "content": list(blocks)})


def to_messages(items: Sequence[msgspec.Raw]) -> Messages:
    out = Messages()
    issued: set[str] = set()  # the calls the request holds: a result names one of them
    for item in items:
        head = msgspec.json.decode(item, type=form.ItemHead)
        if head.role is None and head.type in BLOCK_TYPES:
            out.add("assistant", item)  # verbatim: signatures bind its exact content
            issued.update(call.call_id for call in ANTHROPIC.calls(item))
            continue
        read = form.read_item(item, "an Anthropic model")
        if isinstance(read, form.Message):
            _message(out, read)
        elif isinstance(read, form.CallItem):
            block = {"type": "tool_use", "id": read.call_id, "name": read.name}
            out.add("assistant", block | {"input": form.arguments(read.arguments)})
            issued.add(read.call_id)
        elif isinstance(read, form.Output):
            if read.call_id not in issued:  # its call left the window: its output as text
                text = f"[output of call {read.call_id}]\n{form.text_of(read.output)}"
                out.add("user", {"type": "text", "text": text})
                continue
            content = read.output if isinstance(read.output, str) else _parts(read.output)
            _tool_result(out, {"type": "tool_result", "tool_use_id": read.call_id}, content)
    return out


def _message(out: Messages, message: form.Message) -> None:
    if message.role in ("system", "developer"):
        text = form.text_of(message.content)
        out.system.append(text)
        return
    if message.role not in ("user", "assistant"):
        raise InvalidInput(f"A message of role {message.role!r} is not supported.", param="input")
    if isinstance(message.content, str):
        blocks = [{"type": "text", "text": message.content}] if message.content else []
    else:
        blocks = _parts(message.content or [])
    if blocks:
        out.add(message.role, *blocks)


def _tool_result(out: Messages, block: dict[str, Any], content: Any) -> None:
    if content:
        block["content"] = content
    last = out.messages[-1] if out.messages else None
    if last is not None and last["role"] == "user":
        # A result goes before any text of the same user turn, as the API requires.
        texts = [b for b in last["content"] if _type(b) != "tool_result"]
        results = [b for b in last["content"] if _type(b) == "tool_result"]
        last["content"] = [*results, block, *texts]
    else:
        out.add("user", block)


def _type(block: Any) -> str | None:
    if isinstance(block, msgspec.Raw):
        return msgspec.json.decode(block, type=form.ItemHead).type
    return block.get("type") if isinstance(block, dict) else None


def _parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses content parts as Anthropic blocks: text, images and files by URL or data."""
    return form.content_parts(parts, "an Anthropic model", _text, _media)


def _text(text: Any) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _media(part: dict[str, Any]) -> dict[str, Any] | None:
    kind = part.get("type")
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image", "source": _source(part["image_url"])}
    if kind == "input_file" and isinstance(part.get("file_data") or part.get("file_url"), str):
        return _document(part)
    return None


def _document(part: dict[str, Any]) -> dict[str, Any]:
    """A file part as a ``document`` block: its data (a base64 data URL, or base64 alone, read
    as a PDF) or its URL; its filename as the title. A ``file_id`` names OpenAI's storage,
    which Anthropic cannot read (refused above)."""
    data = part.get("file_data")
    if isinstance(data, str):
        source = _source(
            data if data.startswith("data:") else f"data:application/pdf;base64,{data}"
        )
    else:
        source = {"type": "url", "url": part["file_url"]}
    block: dict[str, Any] = {"type": "document", "source": source}
    if isinstance(part.get("filename"), str):
        block["title"] = part["filename"]
    return block


def _source(url: str) -> dict[str, str]:
    inline = form.data_url(url)
    if inline is not None:
        return {"type": "base64", "media_type": inline[0], "data": inline[1]}
    return {"type": "url", "url": url}


def as_item(block: msgspec.Raw) -> dict[str, Any]:
    """An Anthropic block as the OpenAI surface shows it: thinking (readable or redacted) as a
    ``reasoning`` item, its text as ``summary_text`` (never its signature: sealed by the seam,
    translate/__init__.py ``relayed``); text as an assistant ``message``; a ``tool_use`` as a
    ``function_call`` (its id the ``call_id``). The item's ``id`` is the caller's to give."""
    read = msgspec.json.decode(block, type=_Block)
    if read.type == "text":
        part = {"type": "output_text", "text": read.text, "annotations": []}
        return {"type": "message", "role": "assistant", "content": [part]}
    if read.type == "tool_use":
        arguments = msgspec.json.encode(read.input or {}).decode()
        return {
            "type": "function_call",
            "call_id": read.id,
            "name": read.name,
            "arguments": arguments,
        }
    summary = [{"type": "summary_text", "text": read.thinking}] if read.thinking else []
    return {"type": "reasoning", "summary": summary}


def own_id(block: msgspec.Raw, kind: str | None, given: str | None) -> str | None:
    """The id a block is known by wherever it is shown: its own (a tool_use's), or for
    thinking, which carries none, a digest of its bytes (its signature makes it unique); a
    text block has none (it is listed by its place in its turn)."""
    if kind in OPAQUE_BLOCKS:
        return form.provider_id("reasoning", block)
    return given


class _Anthropic:
    """Anthropic's content blocks as the rest of turnstore reads them (form.Form): each block
    one Responses item."""

    name = "anthropic"
    starts = tuple(b"{" + start.removeprefix(b"{") for start in _STARTS)

    def owns(self, item: msgspec.Raw) -> bool:
        return is_block(item)

    def opaque(self, item: msgspec.Raw) -> bool:
        return msgspec.json.decode(item, type=form.ItemHead).type in OPAQUE_BLOCKS

    def shown(self, item: msgspec.Raw) -> list[form.Shown]:
        head = msgspec.json.decode(item, type=_Block)
        read = as_item(item)
        call_id = head.id if head.type == "tool_use" else None
        own = own_id(item, head.type, head.id or None)
        return [form.Shown(read, form.provider_id(read["type"], item), own, call_id, whole=True)]

    def calls(self, item: msgspec.Raw) -> list[form.FunctionCall]:
        read = msgspec.json.decode(item, type=_ToolUse)
        if read.type != "tool_use":
            return []
        return [
            form.FunctionCall(read.id, read.name, bytes(read.input).decode())
        ]  # the model's text


class _ToolUse(msgspec.Struct):
    type: str
    id: str = ""
    name: str = ""
    input: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))


ANTHROPIC = _Anthropic()
