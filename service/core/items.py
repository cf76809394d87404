"""The item grammar: items as the Responses API defines them, in one place.

Items are kept as the provider's (or the client's) JSON bytes and read only by their heads
(``type``, ``role``, ``call_id``...): the bytes are never rebuilt. Input items a client sends
on the OpenAI surface are checked here before anything is stored.

Items appended without calling the model (``POST /v1/conversations`` with ``items``) become
one committed turn: their bytes are the turn's replay items, re-sent as they came; its
transcript holds their text (the user's and the system's as the user message, the
assistant's as the reply).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import Ids, prefix_of, unstored_id
from service.core.model import Said, Turn
from service.core.strictjson import holds_nul, is_encodable
from service.core.translate import FunctionCall, calls, form_of, readable, shown

# --- items as the provider defines them: read by their heads, never rebuilt ---------------


class _ItemHead(msgspec.Struct):
    type: str | None = None


class _FunctionCallItem(msgspec.Struct):
    type: str | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = ""


def function_calls(items: list[msgspec.Raw]) -> list[FunctionCall]:
    """The function calls among a reply's output items, in order: ``function_call`` items,
    or a provider form's calls (Anthropic's ``tool_use``, Gemini's ``functionCall``, a Chat
    message's ``tool_calls``)."""
    found: list[FunctionCall] = []
    for item in items:
        made = calls(item)
        if made is not None:
            found += made
            continue
        head = msgspec.json.decode(item, type=_FunctionCallItem)
        if head.type == "function_call":
            found.append(FunctionCall(head.call_id, head.name, head.arguments))
    return found


def function_outputs(items: Sequence[msgspec.Raw]) -> list[FunctionCall]:
    """The ``function_call_output`` items among ``items`` (their call ids), in order."""
    heads = (msgspec.json.decode(item, type=_FunctionCallItem) for item in items)
    return [FunctionCall(h.call_id, "", "") for h in heads if h.type == "function_call_output"]


class _InputHead(msgspec.Struct):
    type: str | None = None
    role: str | None = None


def input_count(items: Sequence[msgspec.Raw]) -> int:
    """How many of a turn's items are its input (function outputs and messages the client
    sent), not the provider's output: the leading ones that are not the assistant's."""
    for index, item in enumerate(items):
        if form_of(item) is not None:  # a provider's own item: always its output
            return index
        head = msgspec.json.decode(item, type=_InputHead)
        if head.type not in (None, "message", "function_call_output") or head.role == "assistant":
            return index
    return len(items)


def open_calls(items: Sequence[msgspec.Raw]) -> set[str]:
    """The call ids of the function calls among ``items`` that no output among them answers."""
    return _call_ids(items, "function_call") - _call_ids(items, "function_call_output")


def calls_made(items: Sequence[msgspec.Raw]) -> set[str]:
    """The call ids of the function calls among ``items``, answered or not."""
    return _call_ids(items, "function_call")


def _call_ids(items: Sequence[msgspec.Raw], kind: str) -> set[str]:
    if kind == "function_call":  # a provider form's calls are calls too
        return {c.call_id for c in function_calls(list(items))}
    heads = (msgspec.json.decode(item, type=_FunctionCallItem) for item in items)
    return {h.call_id for h in heads if h.type == kind}


def function_call_output(call_id: str, output: str) -> msgspec.Raw:
    item = {"type": "function_call_output", "call_id": call_id, "output": output}
    return msgspec.Raw(msgspec.json.encode(item))


def compaction_item(items: Sequence[msgspec.Raw]) -> msgspec.Raw | None:
    """The compaction item among a compacted context's items (the last one), if any."""
    for item in reversed(items):
        if msgspec.json.decode(item, type=_ItemHead).type == "compaction":
            return item
    return None


class _Listed(msgspec.Struct):
    id: str | None = None
    call_id: str | None = None
    type: str | None = None
    role: str | None = None


Head = tuple[str | None, str | None, str | None]  # an item's own id, call id, shown type


def _parts(raw: msgspec.Raw) -> list[tuple[Head, msgspec.Raw]]:
    """The items ``raw`` is listed as, each with its head: itself, or the Responses items a
    provider form's item is shown as (service/core/translate/: a Chat message as several)."""
    parts = shown(raw)
    if parts is None:
        head = msgspec.json.decode(raw, type=_Listed)
        return [((head.id, head.call_id, head.type), raw)]
    encode = msgspec.json.encode
    return [((p.own, p.call_id, p.item["type"]), msgspec.Raw(encode(p.item))) for p in parts]


def listed(
    ids: Ids,
    cid: uuid.UUID | None,
    revision: int,
    items: Sequence[msgspec.Raw],
    first: int = 0,
    own_calls: Collection[str] = (),
) -> list[tuple[str, msgspec.Raw]]:
    """The items of the turn that made ``revision`` that the OpenAI surface lists, with the id
    each is known by (one naming its turn, see service/core/ids.py; ``cid`` None: items kept
    nowhere, shown by their own ids; ``first``: the index of the first of ``items`` in its
    turn). The calls of turnstore's own tools that ran inside the turn (``own_calls``, the
    call ids its tool records name) are not listed: a client shown them would try to run them
    itself. Every other item is, whoever made it; a provider form's item as the Responses
    items it is shown as."""
    listing = []
    for index, raw in enumerate(items, start=first):
        for (own, call_id, kind), part in _parts(raw):
            if call_id is None or call_id not in own_calls:
                listing.append((shown_id(ids, cid, revision, index, own, kind), part))
    return listing


def restorable(stored: msgspec.Raw) -> list[tuple[str | None, msgspec.Raw, bool]]:
    """What a reference to each item ``stored`` is listed as restores, with the id that item is
    known by and whether it stands for a provider's own item shown as several: the item
    itself; for a Chat message, the message itself for the part that stands for it (its
    thinking: sent back verbatim to its origin, and its text and calls beside it not twice,
    service/usecases/restore.py), else the Responses item the part is."""
    parts = shown(stored)
    if parts is None:
        return [(msgspec.json.decode(stored, type=_Listed).id, stored, False)]
    several = len(parts) > 1
    encode = msgspec.json.encode
    return [
        (part.own, stored, several)
        if part.whole
        else (part.own, msgspec.Raw(encode(part.item)), False)
        for part in parts
    ]


PLACED = "@"  # a streamed message its provider gave no id (Anthropic's): named by its place


def placed(index: int) -> str:
    """What a streamed message without an id of its own is known by before its turn commits:
    its place in the turn, which is what the turn lists it by."""
    return f"{PLACED}{index}"


def shown_id(
    ids: Ids, cid: uuid.UUID | None, revision: int, index: int, own: str | None, kind: str | None
) -> str:
    """The id an item shows (``own``: the one stored with it, or ``placed``; see
    service/core/ids.py)."""
    if own is not None and own.startswith(PLACED):
        index, own = int(own[len(PLACED) :]), None
    if cid is None:
        return own or unstored_id(prefix_of(kind))
    return ids.item(cid, revision, index, own, kind)


def listed_ids(ids: Ids, cid: uuid.UUID, revision: int, turn: Turn) -> list[str]:
    own = {call.call_id for call in turn.tool_calls}
    return [item_id for item_id, _ in listed(ids, cid, revision, turn.replay_items, 0, own)]


def user_input_item(text: str) -> msgspec.Raw:
    """The Responses API input item for a user message."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return msgspec.Raw(msgspec.json.encode(item))


# --- items a client sends ----------------------------------------------------------------

MAX_ITEMS = 20
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_INPUT_PARTS = frozenset({"input_text", "input_image", "input_file"})
_OUTPUT_PARTS = frozenset({"output_text", "refusal"})  # an assistant message's, replayed


def message_text(item: Any, param: str) -> tuple[str, str]:
    """The role and transcript text of a message item: its text, with a non-text part shown as
    ``[image]`` or ``[file <name>]``."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise InvalidInput(f"{param}: only message items are supported, not {kind!r}.", param=param)
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidInput(f"{param}: role must be one of {sorted(_ROLES)}.", param=param)
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        allowed = _OUTPUT_PARTS if role == "assistant" else _INPUT_PARTS
        text = "".join(_part_text(part, allowed, role, param) for part in content)
    else:
        raise InvalidInput(f"{param}: content must be a string or a list of parts.", param=param)
    _check_text(text, param)
    return str(role), text


def _part_text(part: Any, allowed: frozenset[str], role: str, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in allowed:
        raise InvalidInput(
            f"{param}: a {role} message's parts are {sorted(allowed)}, not {kind!r}.", param=param
        )
    if kind == "input_image":
        if not any(isinstance(part.get(key), str) for key in ("image_url", "file_id")):
            raise InvalidInput(f"{param}: an input_image needs image_url or file_id.", param=param)
        return "[image]"
    if kind == "input_file":
        name = next((part[key] for key in _FILE_NAMES if isinstance(part.get(key), str)), None)
        if name is None or ("file_data" in part and not isinstance(part.get("filename"), str)):
            raise InvalidInput(
                f"{param}: an input_file needs file_id, file_url, or file_data and filename.",
                param=param,
            )
        return f"[file {name}]"
    text = part.get("refusal") if kind == "refusal" else part.get("text")
    if not isinstance(text, str):
        raise InvalidInput(f"{param}: a {kind} part needs its text.", param=param)
    return text


_FILE_NAMES = ("filename", "file_id", "file_url")  # what a file part is shown by, in this order


def _check_text(text: str, param: str) -> None:
    if "\x00" in text or not is_encodable(text):
        raise InvalidInput(f"{param}: text must be valid and without NUL characters.", param=param)


_OPAQUE: dict[str, dict[str, type | tuple[type, ...]]] = {
    # item types kept as they are, and the fields each needs (with their JSON types)
    "reasoning": {"id": str, "summary": list},
    "function_call": {"call_id": str, "name": str, "arguments": str},
    "function_call_output": {"call_id": str, "output": (str, list)},
    "compaction": {"encrypted_content": str},
    "item_reference": {"id": str},
}


def check_item(item: Any, param: str, *, stored: bool = True) -> tuple[str, str] | None:
    """An item a client may send (as input, or appended): checked, and its transcript entry
    (role, text) when it is a message. An ``item_reference`` only in a Response's input, where
    it is restored before it is sent, never appended as it is (``stored``): the provider keeps
    nothing it could refer to."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if holds_nul(item):
        raise InvalidInput(f"{param}: an item holds a NUL character.", param=param)
    if stored and kind == "item_reference":
        raise InvalidInput(
            f"{param}: item_reference is for calls without a conversation; a conversation's "
            "own items are sent with every turn.",
            param=param,
        )
    if isinstance(kind, str) and kind in _OPAQUE:
        wanted = _OPAQUE[kind]
        wrong = [name for name, of in wanted.items() if not isinstance(item.get(name), of)]
        if wrong:
            raise InvalidInput(f"{param}: a {kind} item needs {wrong}.", param=param)
        return None
    return message_text(item, param)


def check_history(items: Sequence[Any]) -> None:
    """A stateless call's input: a history of items turnstore can send, with a user message."""
    said = [check_item(item, "input", stored=False) for item in items]
    if not any(entry is not None and entry[0] == "user" for entry in said):
        raise InvalidInput("input: at least one user message.", param="input")


def items_turn(items: Sequence[Any] | None) -> Turn | None:
    """The turn that appends ``items`` (None for none): their bytes as they came."""
    if not items:
        return None
    if len(items) > MAX_ITEMS:
        raise InvalidInput(f"items: at most {MAX_ITEMS}.", param="items")
    said = tuple(entry for item in items if (entry := check_item(item, "items")) is not None)
    user, assistant = _joined(said)
    return Turn(
        user_message=user,
        assistant_message=assistant,
        replay_items=[msgspec.Raw(msgspec.json.encode(item)) for item in items],
        transcript=said,
    )


def _joined(said: Sequence[Said]) -> tuple[str, str]:
    """The user's (and system's) text and the assistant's text of a transcript: what a
    release without per-message transcripts reads."""
    texts: dict[bool, list[str]] = {True: [], False: []}
    for role, text in said:
        texts[role == "assistant"].append(text)
    return "\n\n".join(texts[False]), "\n\n".join(texts[True])


@dataclass(frozen=True)
class TurnInput:
    """A turn asked with ``input``: its items as sent (a string is one user message), their
    transcript entries, and its message (their text) for the transcript's user side."""

    message: str
    items: tuple[msgspec.Raw, ...]
    said: tuple[Said, ...]


def turn_input(input: str | list[Any]) -> TurnInput:
    if isinstance(input, str):
        return TurnInput(input, (), (("user", input),))
    if not input:
        raise InvalidInput("input: at least one item.", param="input")
    said = tuple(
        entry for item in input if (entry := check_item(item, "input", stored=False)) is not None
    )  # item_references are restored before the turn (service/usecases/restore.py)
    message, _ = _joined(said)
    items = tuple(msgspec.Raw(msgspec.json.encode(item)) for item in input)  # never merged
    return TurnInput(message, items, said)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})


def client_tools(tools: Sequence[Any] | None, reserved: set[str]) -> tuple[msgspec.Raw, ...]:
    """The function tools a client offers the model and runs itself (``reserved``: the names
    of turnstore's own tools, which it may not take)."""
    encoded, names = [], set()
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidInput("tools: only function tools are supported.", param="tools")
        if holds_nul(tool):
            raise InvalidInput("tools: a tool holds a NUL character.", param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name) or name in reserved:
            raise InvalidInput(f"tools: {name!r} is not a usable function name.", param="tools")
        if set(tool) - _TOOL_FIELDS:
            raise InvalidInput(
                f"tools: unsupported fields {sorted(set(tool) - _TOOL_FIELDS)}.", param="tools"
            )
        encoded.append(msgspec.Raw(msgspec.json.encode(tool)))
        names.add(name)
    if len(names) != len(encoded):
        raise InvalidInput("tools: names must be unique.", param="tools")
    return tuple(encoded)


def without_last_item(turn: Turn) -> Turn:
    """``turn`` with its last item removed (the Agents SDK's pop_item); its transcript
    follows when that item was a message."""
    rest = list(turn.replay_items[:-1])
    popped = readable(turn.replay_items[-1])
    if not any(item.get("type", "message") == "message" for item in popped):
        return dataclasses.replace(turn, replay_items=rest)
    decoded = (item for raw in rest for item in readable(raw))
    said = tuple(
        message_text(item, "item_id")
        for item in decoded
        if isinstance(item, dict) and item.get("type", "message") == "message"
    )
    user, assistant = _joined(said)
    return dataclasses.replace(
        turn, replay_items=rest, user_message=user, assistant_message=assistant, transcript=said
    )
