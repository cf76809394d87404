"""Gemini's parts: the form a Gemini turn is kept in, and a request's items as Gemini takes them.

A turn Gemini answered keeps the model ``Content``'s parts as Gemini sent them, one item a part
(``text``, a ``thought`` part, a ``functionCall``, each ``thoughtSignature`` on the part it
came with), byte for byte. One thing is added, never sent: Gemini may give a ``functionCall``
no ``id``, and every surface needs one (a Responses ``call_id``, an Anthropic ``tool_use`` id),
unique in the conversation, so the adapter mints one when the reply arrives and keeps it in
front of the part's own bytes (``{"turnstore_call_id":"call_…",`` then the part without its
opening brace); ``wire`` takes it off again, so Gemini gets back exactly what it sent.

A part is told from a Responses item by its first bytes (a part's first key is one of Gemini's
part fields), then by its head: a Responses item always has a ``type`` or a ``role``, a Gemini
part never.

- ``GEMINI``: the form (form.Form) the rest of turnstore reads parts by: a thought part is
  shown as ``reasoning`` (its text as ``summary_text``), a ``functionCall`` as a
  ``function_call``, text as an assistant message; a thought part, a part with a signature
  and a call are opaque (they go back as they are only to the model that made them); to any
  other provider a part is the Responses item it reads as, without its thinking or its
  signature.
- ``to_contents``: a request's items as Gemini's ``contents`` and ``systemInstruction``. Gemini's
  own parts go as they are (model role); everything else is translated: messages as user or
  model content, system and developer messages into the system instruction, a
  ``function_call`` and its output as a ``functionCall`` and a ``functionResponse`` of the same
  id (the response first in the next user content), consecutive same-role contents merged (in
  the request only). For a model that demands a signature on every function call (Gemini 3),
  a call Gemini never issued carries the placeholder Gemini documents for it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.translate import form

# What Gemini takes on a function call it never issued (its thought-signature docs).
PLACEHOLDER_SIGNATURE = "skip_thought_signature_validator"
MINTED = b'{"turnstore_call_id":"'
# A part's fields (Gemini's Part), and the key turnstore puts in front of a minted call id.
PART_FIELDS = (
    *("text", "thought", "thoughtSignature", "functionCall", "functionResponse", "inlineData"),
    *("fileData", "executableCode", "codeExecutionResult", "videoMetadata", "partMetadata"),
    *("mediaResolution", "toolCall", "toolResponse", "turnstore_call_id"),
)
_STARTS = tuple(b'"' + name.encode() + b'"' for name in PART_FIELDS)
_GENERATION = re.compile(r"gemini-(\d+)")


class _FunctionCall(msgspec.Struct):
    name: str = ""
    id: str | None = None
    args: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))


class _Part(msgspec.Struct, rename="camel"):
    turnstore_call_id: str | None = msgspec.field(default=None, name="turnstore_call_id")
    text: str | None = None
    thought: bool = False
    thought_signature: str | None = None
    function_call: _FunctionCall | None = None


def is_part(item: msgspec.Raw) -> bool:
    """A Gemini part (kept as Gemini sent it), not a Responses item: its first key is a part
    field (whitespace allowed: a whole reply comes pretty-printed), and it has neither a
    ``type`` nor a ``role``."""
    head = memoryview(item)[:48].tobytes()
    if not head.startswith(b"{") or not head[1:].lstrip().startswith(_STARTS):
        return False
    read = msgspec.json.decode(item, type=form.ItemHead)
    return read.type is None and read.role is None


def minted(part: bytes) -> bytes:
    """A ``functionCall`` part without an id of Gemini's, with one minted in front (module
    docstring); any other part as it is."""
    read = msgspec.json.decode(part, type=_Part)
    if read.function_call is None or read.function_call.id or read.turnstore_call_id:
        return part
    call_id = f"call_{os.urandom(12).hex()}"
    return MINTED + call_id.encode() + b'",' + part[1:]


def wire(item: msgspec.Raw) -> msgspec.Raw:
    """A kept part as Gemini sent it: without the call id turnstore minted in front of it."""
    if memoryview(item)[: len(MINTED)].tobytes() != MINTED:
        return item
    kept = bytes(item)
    return msgspec.Raw(b"{" + kept[kept.index(b'",', len(MINTED)) + 2 :])


def signs_calls(model: str) -> bool:
    """Whether ``model`` refuses a function call without a thought signature (Gemini 3 on)."""
    found = _GENERATION.search(model)
    return found is not None and int(found.group(1)) >= 3


def _call_id(read: _Part, item: msgspec.Raw) -> str:
    call = read.function_call
    assert call is not None
    # Never without one (the adapter mints it); a digest keeps it stable if ever.
    return call.id or read.turnstore_call_id or f"call_{hashlib.sha256(item).hexdigest()[:24]}"


class _Gemini:
    """Gemini's parts as the rest of turnstore reads them (form.Form): each part one Responses
    item."""

    name = "gemini"
    starts = tuple(b"{" + start for start in _STARTS)

    def owns(self, item: msgspec.Raw) -> bool:
        return is_part(item)

    def opaque(self, item: msgspec.Raw) -> bool:
        # A call too: the exact form Gemini issued it in (with or without its id, without the
        # placeholder a translated call gets) goes back only to the model that made it.
        read = msgspec.json.decode(item, type=_Part)
        return read.thought or bool(read.thought_signature) or read.function_call is not None

    def shown(self, item: msgspec.Raw) -> list[form.Shown]:
        read = msgspec.json.decode(item, type=_Part)
        if read.function_call is not None:
            call_id = _call_id(read, item)
            called = {
                "type": "function_call",
                "call_id": call_id,
                "name": read.function_call.name,
                "arguments": bytes(read.function_call.args).decode(),
            }
            return [
                form.Shown(called, form.provider_id("function_call", item), call_id, call_id, True)
            ]
        if read.text and not read.thought:
            part = {"type": "output_text", "text": read.text, "annotations": []}
            said = {"type": "message", "role": "assistant", "content": [part]}
            # Known by its place in its turn.
            return [form.Shown(said, form.provider_id("message", item), None, whole=True)]
        # Thought, a signature alone on an empty text, or a part nothing here reads (an image
        # the model made, code it ran): reasoning, readable (its thought) or not; its
        # signature makes its digest unique.
        summary = [{"type": "summary_text", "text": read.text}] if read.text else []
        own = form.provider_id("reasoning", item)
        return [form.Shown({"type": "reasoning", "summary": summary}, own, own, whole=True)]

    def calls(self, item: msgspec.Raw) -> list[form.FunctionCall]:
        read = msgspec.json.decode(item, type=_Part)
        if read.function_call is None:
            return []
        arguments = bytes(read.function_call.args).decode()
        return [form.FunctionCall(_call_id(read, item), read.function_call.name, arguments)]


GEMINI = _Gemini()


# -- a request's items as Gemini's contents ------------------------------------------------


@dataclass
class Contents:
    """A request's conversation as Gemini takes it."""

    system: list[str] = field(default_factory=list)  # system and developer messages' texts
    contents: list[dict[str, Any]] = field(default_factory=list)
    # Each call seen so far: its name and the id Gemini knows it by (None: Gemini gave it none).
    calls: dict[str, tuple[str, str | None]] = field(default_factory=dict)

    def add(self, role: str, *parts: Any) -> None:
        """Parts of ``role``, appended to the last content when it is that role's."""
        if self.contents and self.contents[-1]["role"] == role:
            self.contents[-1]["parts"].extend(parts)
        else:
            self.contents.append({"role": role, "parts": list(parts)})


def to_contents(items: Sequence[msgspec.Raw], model: str) -> Contents:
    """``items`` (Gemini's parts and Responses items: another provider's own items were made
    Responses items before, translate/__init__.py ``for_form``) as Gemini's contents."""
    out = Contents()
    signed = signs_calls(model)
    for item in items:
        if is_part(item):
            read = msgspec.json.decode(item, type=_Part)
            if read.function_call is not None:
                out.calls[_call_id(read, item)] = (read.function_call.name, read.function_call.id)
            out.add("model", wire(item))  # verbatim: its signature binds its exact content
            continue
        call = form.read_item(item, "a Gemini model")
        if isinstance(call, form.Message):
            _message(out, call)
        elif isinstance(call, form.CallItem):
            part: dict[str, Any] = {
                "functionCall": {
                    "id": call.call_id,
                    "name": call.name,
                    "args": form.arguments(call.arguments),
                }
            }
            if signed:  # a call Gemini never issued: the documented placeholder
                part["thoughtSignature"] = PLACEHOLDER_SIGNATURE
            out.calls[call.call_id] = (call.name, call.call_id)
            out.add("model", part)
        elif isinstance(call, form.Output):
            _response(out, call)
    return out


def _message(out: Contents, message: form.Message) -> None:
    if message.role in ("system", "developer"):
        text = form.text_of(message.content)
        if text:
            out.system.append(text)
        return
    if message.role not in ("user", "assistant"):
        raise InvalidInput(f"A message of role {message.role!r} is not supported.", param="input")
    if isinstance(message.content, str):
        parts = [{"text": message.content}] if message.content else []
    else:
        parts = _parts(message.content or [])
    if parts:
        out.add("model" if message.role == "assistant" else "user", *parts)


def _response(out: Contents, result: form.Output) -> None:
    """A function's output as a ``functionResponse`` of its call's name and id, before any
    text of the same user content; an output whose call is not in the request (it fell out of
    the window) as text, which Gemini takes without a call before it."""
    output = result.output
    text = form.text_of(output)
    media = [] if isinstance(output, str) else [p for p in output if p.get("type") != "input_text"]
    extra = _parts(media)
    if result.call_id not in out.calls:
        out.add("user", {"text": f"[output of call {result.call_id}]\n{text}"}, *extra)
        return
    name, wire_id = out.calls[result.call_id]
    response: dict[str, Any] = {"name": name, "response": {"output": text}}
    if wire_id is not None:
        response = {"id": wire_id, **response}
    part = {"functionResponse": response}
    last = out.contents[-1] if out.contents else None
    if last is not None and last["role"] == "user":
        answers = [p for p in last["parts"] if "functionResponse" in p]
        rest = [p for p in last["parts"] if "functionResponse" not in p]
        last["parts"] = [*answers, part, *rest, *extra]
    else:
        out.add("user", part, *extra)


def _parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses content parts as Gemini's: text, images and files inline or by URI."""
    return form.content_parts(parts, "a Gemini model", lambda text: {"text": text}, _other)


def _other(part: dict[str, Any]) -> dict[str, Any] | None:
    """An image or a file part: inline (a data URL) or by URI; None: another part."""
    kind = part.get("type")
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return _media(part["image_url"], None)
    if kind == "input_file" and isinstance(part.get("file_data"), str):
        data = part["file_data"]
        return _media(data if data.startswith("data:") else _pdf(data), None)
    if kind == "input_file" and isinstance(part.get("file_url"), str):
        return _media(part["file_url"], "application/pdf")
    return None


def _pdf(data: str) -> str:
    return f"data:application/pdf;base64,{data}"


def _media(url: str, mime_type: str | None) -> dict[str, Any]:
    inline = form.data_url(url)
    if inline is not None:
        return {"inlineData": {"mimeType": inline[0], "data": inline[1]}}
    uri: dict[str, str] = {"fileUri": url}
    if mime_type is not None:
        uri = {"mimeType": mime_type, **uri}
    return {"fileData": uri}
