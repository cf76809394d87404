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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import view_item_id
from service.core.model import Turn
from service.core.strictjson import is_encodable

# --- items as the provider defines them: read by their heads, never rebuilt ---------------


class _ItemHead(msgspec.Struct):
    type: str | None = None
    encrypted_content: str | None = None


@dataclass(frozen=True)
class FunctionCall:
    call_id: str
    name: str
    arguments: str  # the model's JSON text, unparsed: the tool gate judges it


class _FunctionCallItem(msgspec.Struct):
    type: str | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = ""


def function_calls(items: list[msgspec.Raw]) -> list[FunctionCall]:
    """The ``function_call`` items among a reply's output items, in order."""
    heads = (msgspec.json.decode(item, type=_FunctionCallItem) for item in items)
    return [
        FunctionCall(h.call_id, h.name, h.arguments) for h in heads if h.type == "function_call"
    ]


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
        head = msgspec.json.decode(item, type=_InputHead)
        if head.type not in (None, "message", "function_call_output") or head.role == "assistant":
            return index
    return len(items)


def open_calls(items: Sequence[msgspec.Raw]) -> set[str]:
    """The call ids of the function calls among ``items`` that no output among them answers."""
    heads = [msgspec.json.decode(item, type=_FunctionCallItem) for item in items]
    called = {h.call_id for h in heads if h.type == "function_call"}
    return called - {h.call_id for h in heads if h.type == "function_call_output"}


def function_call_output(call_id: str, output: str) -> msgspec.Raw:
    item = {"type": "function_call_output", "call_id": call_id, "output": output}
    return msgspec.Raw(msgspec.json.encode(item))


def is_sealed_reasoning(item: msgspec.Raw) -> bool:
    """A reasoning item whose encrypted_content only the provider that made it can open."""
    head = msgspec.json.decode(item, type=_ItemHead)
    return head.type == "reasoning" and bool(head.encrypted_content)


def run_inside(items: Sequence[msgspec.Raw]) -> set[str]:
    """The call ids of the calls turnstore's own tools ran inside the turn of ``items``:
    answered in the same turn, after the call (a client's calls are answered by its next
    turn)."""
    called, inside = set(), set()
    for item in items:
        head = msgspec.json.decode(item, type=_FunctionCallItem)
        if head.type == "function_call":
            called.add(head.call_id)
        elif head.type == "function_call_output" and head.call_id in called:
            inside.add(head.call_id)
    return inside


class _Listed(msgspec.Struct):
    id: str | None = None
    call_id: str | None = None


def listed(
    cid: uuid.UUID, revision: int, items: Sequence[msgspec.Raw], first: int = 0
) -> list[tuple[str, msgspec.Raw]]:
    """The items of the turn that made ``revision`` that the OpenAI surface lists, with the id
    each is known by (its own, or a view-only id naming its place; ``first``: the index of the
    first of ``items`` in its turn). The calls turnstore's own tools ran inside the turn are
    not listed: a client shown them would try to run them itself."""
    inside = run_inside(items)
    shown = []
    for index, raw in enumerate(items, start=first):
        head = msgspec.json.decode(raw, type=_Listed)
        if head.call_id is None or head.call_id not in inside:
            shown.append((head.id or view_item_id(cid, revision, index), raw))
    return shown


def listed_item_ids(cid: uuid.UUID, revision: int, items: Sequence[msgspec.Raw]) -> list[str]:
    return [item_id for item_id, _ in listed(cid, revision, items)]


def user_input_item(text: str) -> msgspec.Raw:
    """The Responses API input item for a user message."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return msgspec.Raw(msgspec.json.encode(item))


# --- items a client sends ----------------------------------------------------------------

MAX_ITEMS = 20
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text"}


def message_text(item: Any, param: str) -> tuple[str, str]:
    """The role and text of a message item (its content a string or text parts)."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise InvalidInput(f"{param}: only message items are supported, not {kind!r}.", param=param)
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in _ROLES:
        raise InvalidInput(f"{param}: role must be one of {sorted(_ROLES)}.", param=param)
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        want = _TEXT_PARTS.get(role, "output_text")
        parts = [p for p in content if isinstance(p, dict)]
        texts = [p.get("text") for p in parts]
        if (
            len(parts) != len(content)
            or any(p.get("type") != want for p in parts)
            or not all(isinstance(t, str) for t in texts)
        ):
            raise InvalidInput(f"{param}: {role} content must be text ({want}) parts.", param=param)
        text = "".join(texts)  # type: ignore[arg-type]
    else:
        raise InvalidInput(f"{param}: content must be a string or a list of parts.", param=param)
    if "\x00" in text or not is_encodable(text):
        raise InvalidInput(f"{param}: text must be valid and without NUL characters.", param=param)
    return str(role), text


_OPAQUE: dict[str, dict[str, type | tuple[type, ...]]] = {
    # item types appended as they are, and the fields each needs (with their JSON types)
    "reasoning": {"id": str, "summary": list},
    "function_call": {"call_id": str, "name": str, "arguments": str},
    "function_call_output": {"call_id": str, "output": (str, list)},
}


def is_opaque(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(kind := item.get("type"), str) and kind in _OPAQUE


def check_opaque(item: dict[str, Any], param: str = "items") -> None:
    fields = _OPAQUE[item["type"]]
    wrong = [name for name, kind in fields.items() if not isinstance(item.get(name), kind)]
    if wrong:
        raise InvalidInput(f"{param}: a {item['type']} item needs {wrong}.", param=param)


def check_history(items: Sequence[Any]) -> None:
    """A stateless call's input: a history of items turnstore can send, with a user message."""
    users = 0
    for item in items:
        if is_opaque(item):
            check_opaque(item, "input")
        elif isinstance(item, dict) and item.get("type") == "item_reference":
            if not isinstance(item.get("id"), str):
                raise InvalidInput("input: an item_reference needs its id.", param="input")
        else:
            role, _ = message_text(item, "input")
            users += role == "user"
    if not users:
        raise InvalidInput("input: at least one user message.", param="input")


def items_turn(items: Sequence[Any] | None) -> Turn | None:
    """The turn that appends ``items`` (None for none)."""
    if not items:
        return None
    if len(items) > MAX_ITEMS:
        raise InvalidInput(f"items: at most {MAX_ITEMS}.", param="items")
    messages = []
    for item in items:
        if is_opaque(item):
            check_opaque(item)  # kept as sent: what a model produced, or a tool's answer
        else:
            messages.append(item)
    user, assistant = _transcript(messages)
    return Turn(
        user_message=user,
        assistant_message=assistant,
        replay_items=[msgspec.Raw(msgspec.json.encode(item)) for item in items],
    )


def _transcript(messages: Sequence[Any]) -> tuple[str, str]:
    """The user's (and system's) text and the assistant's text of these message items."""
    said: dict[bool, list[str]] = {True: [], False: []}
    for item in messages:
        role, text = message_text(item, "items")
        said[role == "assistant"].append(text)
    return "\n\n".join(said[False]), "\n\n".join(said[True])


def turn_input(input: str | list[Any]) -> tuple[str, tuple[msgspec.Raw, ...]]:
    """A turn asked with ``input``: its message text, and its input items when they are more
    than one user message (answers to the client's function calls, as sent)."""
    if isinstance(input, str):
        return input, ()
    if not input:
        raise InvalidInput("input: at least one item.", param="input")
    texts, answers = [], False
    for item in input:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id or not isinstance(output, str | list):
                raise InvalidInput(
                    "input: a function_call_output needs call_id and output.", param="input"
                )
            answers = True
            continue
        role, text = message_text(item, "input")
        if role != "user":
            raise InvalidInput(
                "input: only user messages and function outputs start a turn.", param="input"
            )
        texts.append(text)
    message = "\n\n".join(texts)
    items = tuple(msgspec.Raw(msgspec.json.encode(item)) for item in input) if answers else ()
    return message, items


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})


def client_tools(tools: Sequence[Any] | None, reserved: set[str]) -> tuple[msgspec.Raw, ...]:
    """The function tools a client offers the model and runs itself (``reserved``: the names
    of turnstore's own tools, which it may not take)."""
    encoded, names = [], set()
    for tool in tools or ():
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidInput("tools: only function tools are supported.", param="tools")
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
    """``turn`` with its last item removed (the Agents SDK's pop_item); its transcript texts
    follow when that item was a message."""
    rest = list(turn.replay_items[:-1])
    popped = msgspec.json.decode(turn.replay_items[-1])
    if not isinstance(popped, dict) or popped.get("type", "message") != "message":
        return dataclasses.replace(turn, replay_items=rest)
    decoded = (msgspec.json.decode(raw) for raw in rest)
    user, assistant = _transcript(
        [i for i in decoded if isinstance(i, dict) and i.get("type", "message") == "message"]
    )
    return dataclasses.replace(
        turn, replay_items=rest, user_message=user, assistant_message=assistant
    )
