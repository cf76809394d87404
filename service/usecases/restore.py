"""Items a client sends back as turnstore showed them, restored to what is stored.

A client that keeps its own history sends back what it was shown: reasoning without its
``encrypted_content`` (listed without ``include``), ``item_reference``s, items under the ids
turnstore showed (service/core/ids.py), not the provider's. Wherever such items enter (a
stateless or stored response's ``input``, items appended to a conversation) they are replaced
by the stored copies, byte for byte, so the provider gets back exactly what it made.

An id is looked up in the conversations the request's shown ids name (each names its
conversation). An id found nowhere there, or another owner's, is 400 (``param``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import view_item_conversation
from service.core.items import shown_id
from service.store.ports import ConversationStore


class _Head(msgspec.Struct):
    id: str | None = None


class Restorer:
    def __init__(self, store: ConversationStore) -> None:
        self._store = store

    async def restore(
        self, owner: str, items: Sequence[dict[str, Any]], param: str = "input"
    ) -> list[msgspec.Raw]:
        """The items as they came, except those only the stored copy completes."""
        stored = await self._stored(owner, items)
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

    async def _stored(self, owner: str, items: Sequence[dict[str, Any]]) -> dict[str, msgspec.Raw]:
        """The stored items of the conversations the request's shown ids name, by id."""
        named = {
            cid
            for item in items
            if isinstance(item.get("id"), str) and (cid := view_item_conversation(item["id"]))
        }
        found: dict[str, msgspec.Raw] = {}
        for cid in named:
            conversation = await self._store.load(cid, owner)
            if conversation is None:
                continue
            for revision, turn in enumerate(conversation.turns, start=1):
                for index, raw in enumerate(turn.replay_items):
                    head = msgspec.json.decode(raw, type=_Head)
                    found[shown_id(cid, revision, index, head.id)] = raw
                for raw in turn.compacted:  # its compaction item, shown in its Response
                    head = msgspec.json.decode(raw, type=_Head)
                    if head.id is not None:
                        found[shown_id(cid, revision, 0, head.id)] = raw
        return found
