"""Reading a conversation's turns a page at a time: what a reader holds is a page, whatever
the conversation's size (the contract's Limits). The item listings walk its turns this way.
And what a conversation holds (MAX_CONVERSATION_BYTES) where its row does not say it all.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Protocol

from service.core.model import Turn
from service.core.sizes import turn_bytes
from service.store.ports import Reads

PAGE_TURNS = 4  # turns per read of a walk over a conversation's turns


class Stored(Protocol):
    """What a conversation's row says of its size (Conversation, ConversationInfo)."""

    @property
    def stored_bytes(self) -> int | None: ...
    @property
    def stored_revision(self) -> int | None: ...
    @property
    def rewritten_at(self) -> int: ...


async def walk(
    store: Reads,
    cid: uuid.UUID,
    owner: str,
    low: int,
    high: int,
    *,
    newest_first: bool,
) -> AsyncGenerator[tuple[int, Turn], None]:
    """Turns ``low``..``high`` of ``owner``'s conversation with their revisions, oldest or
    newest first, a page at a time (none for a conversation the store would not find)."""
    while low <= high:
        page = await store.turns(cid, owner, low, high, newest_first=newest_first, limit=PAGE_TURNS)
        if not page:
            return
        last = page[-1][0]
        for numbered in page:
            yield numbered
        del page, numbered  # not held while the next page is read
        if newest_first:
            high = last - 1
        else:
            low = last + 1


async def held_bytes(
    store: Reads, cid: uuid.UUID, owner: str, revision: int, stored: Stored
) -> int:
    """What turns 1..``revision`` of the conversation hold (service/core/sizes.py): the size
    its row stores, counted up to ``stored_revision``, plus the turns after it (those an older
    release committed since, which leave the count behind). Where no size is stored (forked,
    an item removed, here or by an older release since the count), every turn is counted,
    once: the next commit keeps the total. Turns are measured in the database, in one read;
    the ones it cannot measure (sealed) are read one at a time."""
    counted, up_to = stored.stored_bytes, stored.stored_revision
    if counted is not None and up_to is not None and stored.rewritten_at <= up_to <= revision:
        held, low = counted, up_to + 1
    else:
        held, low = 0, 1
    if low > revision:
        return held
    for seq, size in await store.turn_sizes(cid, owner, low, revision):
        if size is None:
            turn = await store.turn(cid, owner, seq)
            size = turn_bytes(turn) if turn is not None else 0
        held += size
    return held
