"""Items a client sends back as turnstore showed them, restored to what is stored.

A client that keeps its own history sends back what it was shown: reasoning without its
``encrypted_content`` (listed without ``include``), ``item_reference``s, items under the ids
turnstore showed (service/core/ids.py), not the provider's. Wherever such items enter (a
stateless or stored response's ``input``, items appended to a conversation) they are replaced
by the stored copies, byte for byte, so the provider gets back exactly what it made.

An id is looked up in the conversations the request's shown ids name (each names its
conversation), at most MAX_CONVERSATIONS of them, read a page of turns at a time until every
id is found (memory: the items restored and a page). An id found nowhere there, or another
owner's, is 400 (``param``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
from uuid import UUID

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import view_item_conversation
from service.core.items import shown_id
from service.core.model import Turn
from service.store.ports import ConversationStore


class _Head(msgspec.Struct):
    id: str | None = None


MAX_CONVERSATIONS = 20  # a request may name items of at most this many conversations
PAGE_TURNS = 4


class Restorer:
    def __init__(self, store: ConversationStore) -> None:
        self._store = store

    async def restore(
        self, owner: str, items: Sequence[dict[str, Any]], param: str = "input"
    ) -> list[msgspec.Raw]:
        """The items as they came, except those only the stored copy completes."""
        stored = await self._stored(owner, items, param)
        restored = []
        for item in items:
            item_id = item.get("id")
            kind = item.get("type", "message")
            needs_store = (
                kind == "item_reference"
                or (kind == "reasoning" and not item.get("encrypted_content"))
                or (isinstance(item_id, str) and view_item_conversation(item_id) is not None)
            )
            if not needs_store:
                restored.append(msgspec.Raw(msgspec.json.encode(item)))
                continue
            if not isinstance(item_id, str) or item_id not in stored:
                raise InvalidInput(f"{param}: no stored item {item_id!r} of yours.", param=param)
            restored.append(stored[item_id])
        return restored

    async def _stored(
        self, owner: str, items: Sequence[dict[str, Any]], param: str
    ) -> dict[str, msgspec.Raw]:
        """The stored items the request's shown ids name, by id."""
        wanted: dict[UUID, set[str]] = {}
        for item in items:
            item_id = item.get("id")
            if isinstance(item_id, str) and (cid := view_item_conversation(item_id)):
                wanted.setdefault(cid, set()).add(item_id)
        if len(wanted) > MAX_CONVERSATIONS:
            raise InvalidInput(
                f"{param}: items of at most {MAX_CONVERSATIONS} conversations in one request.",
                param=param,
            )
        found: dict[str, msgspec.Raw] = {}
        for cid, ids in wanted.items():
            found |= await self._found(owner, cid, ids)
        return found

    async def _found(self, owner: str, cid: UUID, ids: set[str]) -> dict[str, msgspec.Raw]:
        """Those of ``ids`` stored in ``cid``: its turns read newest first, a page at a time,
        until all are found (a client sends back what it saw last, mostly)."""
        found: dict[str, msgspec.Raw] = {}
        high = 2**31 - 1
        while len(found) < len(ids) and high >= 1:
            page = await self._store.turns(cid, owner, 1, high, newest_first=True, limit=PAGE_TURNS)
            for revision, turn in page:
                for index, raw in enumerate(turn.replay_items):
                    head = msgspec.json.decode(raw, type=_Head)
                    if (shown := shown_id(cid, revision, index, head.id)) in ids:
                        found[shown] = raw
                for raw in turn.compacted:  # its compaction item, shown in its Response
                    head = msgspec.json.decode(raw, type=_Head)
                    if (
                        head.id is not None
                        and (shown := shown_id(cid, revision, 0, head.id)) in ids
                    ):
                        found[shown] = raw
            if len(page) < PAGE_TURNS:
                break
            high = page[-1][0] - 1
        return found


def _shown(cid: UUID, revision: int, turn: Turn) -> Iterator[tuple[str, msgspec.Raw]]:
    """A turn's stored items by the ids they are shown by: its items, and its compaction item
    (shown in its Response; the kept messages of a compacted context are never shown)."""
    for index, raw in enumerate(turn.replay_items):
        yield shown_id(cid, revision, index, msgspec.json.decode(raw, type=_Head).id), raw
    for raw in turn.compacted:
        own = msgspec.json.decode(raw, type=_Head).id
        if own is not None:
            yield shown_id(cid, revision, 0, own), raw
