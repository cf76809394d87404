"""A conversation's items as the OpenAI surface shows them: a view over the replay items.

The stored bytes never change. The view adds what OpenAI's item types require and a stored
item may lack (an ``id``, a ``status``), hides ``encrypted_content`` unless it is asked for,
and leaves out the function calls of turnstore's own tools (TOOLS): they ran inside their
turn, and a client shown them would try to run them itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from service.api.compat.ids import view_item_id
from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    ItemNotFound,
    PreconditionFailed,
)
from service.core.items import run_inside, without_last_item
from service.core.model import Append, Conversation, ConversationInfo, Precondition, Turn
from service.core.plans import check_precondition
from service.store.ports import ConversationStore

ENCRYPTED = "reasoning.encrypted_content"
INCLUDABLE = frozenset({ENCRYPTED, "message.output_text.logprobs"})
_STATUSED = frozenset({"message", "function_call", "function_call_output"})


@dataclass(frozen=True)
class ItemPage:
    data: list[dict[str, Any]]
    has_more: bool
    revision: int = 0  # of the conversation, for the ETag of an append

    def body(self) -> dict[str, Any]:
        data = self.data
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": self.has_more,
        }


def includes(include: Sequence[str] | None) -> bool:
    """Whether ``include`` asks for encrypted reasoning (400 for what is not includable)."""
    for value in include or ():
        if value not in INCLUDABLE:
            raise InvalidInput(f"include: {value!r} is not supported.", param="include")
    return ENCRYPTED in (include or ())


def turn_items(
    cid: uuid.UUID, revision: int, turn: Turn, *, encrypted: bool
) -> list[dict[str, Any]]:
    """The shown items of the turn that made ``revision``, in commit order."""
    return _shown_items(cid, revision, turn.replay_items, 0, encrypted)


def output_items(
    cid: uuid.UUID,
    revision: int,
    items: Sequence[msgspec.Raw],
    first: int,
    *,
    encrypted: bool = False,
) -> list[dict[str, Any]]:
    """A Response's output: the turn's items after its ``first`` input items."""
    return _shown_items(cid, revision, items, first, encrypted=encrypted)


def _shown_items(
    cid: uuid.UUID, revision: int, raws: Sequence[msgspec.Raw], first: int, encrypted: bool
) -> list[dict[str, Any]]:
    inside = run_inside(raws)
    items = [msgspec.json.decode(raw) for raw in raws]
    return [
        _shown(item, cid, revision, index, encrypted)
        for index, item in enumerate(items, start=first)
        if isinstance(item, dict) and item.get("call_id") not in inside
    ]


def _shown(
    item: dict[str, Any], cid: uuid.UUID, revision: int, index: int, encrypted: bool
) -> dict[str, Any]:
    item.setdefault("type", "message")
    item.setdefault("id", view_item_id(cid, revision, index))
    if item["type"] in _STATUSED:
        item.setdefault("status", "completed")
    if item["type"] == "message" and isinstance(item.get("content"), str):
        # As a client may send it: shown as a part.
        text = item["content"]
        assistant = item.get("role") == "assistant"
        part = (
            {"type": "output_text", "text": text, "annotations": []}
            if assistant
            else {"type": "input_text", "text": text}
        )
        item["content"] = [part]
    if item["type"] == "reasoning" and not encrypted:
        item.pop("encrypted_content", None)
    return item


def all_items(conversation: Conversation, *, encrypted: bool) -> list[dict[str, Any]]:
    cid = conversation.id
    return [
        item
        for revision, turn in enumerate(conversation.turns, start=1)
        for item in turn_items(cid, revision, turn, encrypted=encrypted)
    ]


def page(items: list[dict[str, Any]], *, after: str | None, limit: int, order: str) -> ItemPage:
    """``limit`` items in ``order`` after the item ``after`` (in that order)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidInput("after: no such item in this conversation.", param="after")
        start = ids.index(after) + 1
    chosen = ordered[start : start + limit]
    return ItemPage(chosen, has_more=start + limit < len(ordered))


def find(items: list[dict[str, Any]], item_id: str) -> dict[str, Any]:
    for item in items:
        if item["id"] == item_id:
            return item
    raise ItemNotFound()


async def load_items(
    store: ConversationStore, cid: uuid.UUID, owner: str, include: Sequence[str] | None
) -> list[dict[str, Any]]:
    encrypted = includes(include)
    conversation = await store.load(cid, owner)
    if conversation is None:
        raise ConversationNotFound()
    return all_items(conversation, encrypted=encrypted)


async def append_items(
    store: ConversationStore,
    cid: uuid.UUID,
    owner: str,
    turn: Turn | None,
    if_match: Precondition,
    include: Sequence[str] | None,
) -> ItemPage:
    """Commit ``turn`` (items appended without the model) on top of the conversation's
    current revision: 409 conversation_conflict if another turn commits or runs meanwhile."""
    encrypted = includes(include)
    if turn is None:
        raise InvalidInput("items: at least one.", param="items")
    info = await store.describe(cid, owner)
    if info is None:
        raise ConversationNotFound()
    check_precondition(if_match, info.revision)
    commit = await store.append(Append(cid, turn, info.revision, owner=owner))
    return ItemPage(
        turn_items(cid, commit.revision, turn, encrypted=encrypted), False, commit.revision
    )


async def pop_item(
    store: ConversationStore, cid: uuid.UUID, owner: str, item_id: str, if_match: Precondition
) -> ConversationInfo:
    """Remove ``item_id`` if it is the conversation's latest item (the Agents SDK's pop_item);
    any other item is 400, an unknown one 404. A commit between the look and the removal
    makes it 409, with nothing removed."""
    conversation = await store.load(cid, owner)
    if conversation is None:
        raise ConversationNotFound()
    check_precondition(if_match, conversation.revision)
    shown = all_items(conversation, encrypted=False)
    find(shown, item_id)
    if shown[-1]["id"] != item_id:
        raise InvalidInput("Only the latest item can be removed.", param="item_id")
    try:
        info, _ = await store.pop_item(
            cid, owner, without_last_item, frozenset({conversation.revision})
        )
    except PreconditionFailed:
        raise ConversationConflict() from None
    return info
