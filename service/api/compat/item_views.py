"""A conversation's items as the OpenAI surface shows them: a view over the replay items.

The stored bytes never change. The view adds what OpenAI's item types require and a stored
item may lack (an ``id``: the one service/core/items.py ``listed`` gives it, a ``status``), and
hides ``encrypted_content`` unless it is asked for.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from service.core.errors import InvalidInput, ItemNotFound
from service.core.ids import Ids
from service.core.items import compaction_item, input_count, listed
from service.core.model import Turn

ENCRYPTED = "reasoning.encrypted_content"
INCLUDABLE = frozenset({ENCRYPTED, "message.output_text.logprobs"})
_STATUSED = frozenset({"message", "function_call", "function_call_output"})


@dataclass(frozen=True)
class ItemPage:
    data: list[dict[str, Any]]
    has_more: bool

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
    ids: Ids, cid: uuid.UUID, revision: int, turn: Turn, *, encrypted: bool
) -> list[dict[str, Any]]:
    """The shown items of the turn that made ``revision``, in commit order: its input items,
    the compaction item it ran on (if it compacted: as its Response's output holds it), then
    its output items."""
    own = {call.call_id for call in turn.tool_calls}
    first = input_count(turn.replay_items)
    inputs = output_items(ids, cid, revision, turn.replay_items[:first], 0, encrypted=encrypted)
    outputs = output_items(
        ids,
        cid,
        revision,
        turn.replay_items[first:],
        first,
        encrypted=encrypted,
        own_calls=own,
        compaction=compaction_item(turn.compacted),
    )
    return [*inputs, *outputs]


def output_items(
    ids: Ids,
    cid: uuid.UUID | None,
    revision: int,
    items: Sequence[msgspec.Raw],
    first: int,
    *,
    encrypted: bool = False,
    own_calls: Collection[str] = (),
    compaction: msgspec.Raw | None = None,
) -> list[dict[str, Any]]:
    """The shown items among ``items``, the turn's items from its ``first`` (a Response's
    output: those after its input items, after the ``compaction`` item the turn ran on, as
    OpenAI's output holds it); ``cid``, ``own_calls``: see core.items.listed."""
    shown = [
        _shown(msgspec.json.decode(raw), item_id, encrypted)
        for item_id, raw in listed(ids, cid, revision, items, first, own_calls)
    ]
    if compaction is not None:
        [(item_id, raw)] = listed(ids, cid, revision, [compaction], len(items) + first)
        shown.insert(0, _shown(msgspec.json.decode(raw), item_id, encrypted))
    return shown


def _shown(item: dict[str, Any], item_id: str, encrypted: bool) -> dict[str, Any]:
    item.setdefault("type", "message")
    item["id"] = item_id
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
    elif item["type"] == "message" and isinstance(item.get("content"), list):
        for part in item["content"]:
            if isinstance(part, dict) and part.get("type") == "input_image":
                part.setdefault("detail", "auto")  # OpenAI's default, which its types require
    if item["type"] == "reasoning" and not encrypted:
        item.pop("encrypted_content", None)
    return item


async def page_of(
    ids: Ids,
    turns: AsyncIterator[tuple[int, Turn]],
    cid: uuid.UUID,
    *,
    after: str | None,
    limit: int,
    newest_first: bool,
    encrypted: bool,
) -> ItemPage:
    """``limit`` items after the item ``after``, walking ``turns`` (newest first or oldest
    first, as they come) only as far as the page needs."""
    chosen: list[dict[str, Any]] = []
    passed = after is None
    async for revision, turn in turns:
        shown = turn_items(ids, cid, revision, turn, encrypted=encrypted)
        for item in reversed(shown) if newest_first else shown:
            if not passed:
                passed = item["id"] == after
            elif len(chosen) == limit:
                return ItemPage(chosen, has_more=True)
            else:
                chosen.append(item)
    if not passed:
        raise InvalidInput("after: no such item in this conversation.", param="after")
    return ItemPage(chosen, has_more=False)


def one_of(shown: list[dict[str, Any]], item_id: str) -> dict[str, Any]:
    """The item shown by ``item_id`` among ``shown`` (ItemNotFound: none)."""
    for item in shown:
        if item["id"] == item_id:
            return item
    raise ItemNotFound()


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
