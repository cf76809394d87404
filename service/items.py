"""Input items a client sends on the OpenAI surface, checked before anything is stored.

Items appended without calling the model (``POST /v1/conversations`` with ``items``) become
one committed turn: their bytes are the turn's replay items, re-sent as they came; its
transcript holds their text (the user's and the system's as the user message, the
assistant's as the reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from service.errors import InvalidInput
from service.model import Turn
from service.strictjson import is_encodable

MAX_ITEMS = 20
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text"}


def message_text(item: Any, param: str) -> tuple[str, str]:
    """The role and text of a message item (its content a string or text parts)."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise InvalidInput(f"{param}: only message items are supported, not {kind!r}.", param=param)
    role, content = item.get("role"), item.get("content")
    if role not in _ROLES:
        raise InvalidInput(f"{param}: role must be one of {sorted(_ROLES)}.", param=param)
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        want = _TEXT_PARTS.get(role, "output_text")
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        types = {p.get("type") for p in content if isinstance(p, dict)}
        if (
            len(texts) != len(content)
            or types - {want}
            or not all(isinstance(t, str) for t in texts)
        ):
            raise InvalidInput(f"{param}: {role} content must be text ({want}) parts.", param=param)
        text = "".join(texts)  # type: ignore[arg-type]
    else:
        raise InvalidInput(f"{param}: content must be a string or a list of parts.", param=param)
    if "\x00" in text or not is_encodable(text):
        raise InvalidInput(f"{param}: text must be valid and without NUL characters.", param=param)
    return str(role), text


def items_turn(items: Sequence[Any] | None) -> Turn | None:
    """The turn that appends ``items`` (None for none)."""
    if not items:
        return None
    if len(items) > MAX_ITEMS:
        raise InvalidInput(f"items: at most {MAX_ITEMS}.", param="items")
    said: dict[bool, list[str]] = {True: [], False: []}
    for item in items:
        role, text = message_text(item, "items")
        said[role == "assistant"].append(text)
    return Turn(
        user_message="\n\n".join(said[False]),
        assistant_message="\n\n".join(said[True]),
        replay_items=[msgspec.Raw(msgspec.json.encode(item)) for item in items],
    )


def input_text(input: str | list[Any]) -> str:
    """The user message of a turn asked with ``input``: a string, or user message items."""
    if isinstance(input, str):
        return input
    if not input:
        raise InvalidInput("input: at least one item.", param="input")
    texts = []
    for item in input:
        role, text = message_text(item, "input")
        if role != "user":
            raise InvalidInput("input: only user messages can start a turn.", param="input")
        texts.append(text)
    return "\n\n".join(texts)
