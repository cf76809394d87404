"""A replica-local history cache in front of the PostgreSQL store.

Every load still asks the database, in one query, for the conversation row and only the turns
committed after the revision cached here: nothing more when the cache is current, a few rows
when another replica committed meanwhile. This is correct because committed turns never
change and only disappear together with their conversation; the conversation row itself is
always read fresh, so its revision, timestamps and any other conversation-level field are
never served from memory. Only turns are cached, bounded by their bytes, least recently used
out first. Nothing here changes what clients see.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from uuid import UUID

import msgspec

from service.core.model import (
    ANONYMOUS,
    Append,
    Commit,
    Conversation,
    ConversationInfo,
    LeaseAttempt,
    LeaseRequest,
    Metadata,
    PageRequest,
    Precondition,
    Summary,
    TranscriptPage,
    Turn,
)
from service.store.ports import ConversationStore


@dataclass(frozen=True)
class _Entry:
    revision: int
    created_at: datetime  # tells a conversation from a later one that reuses its id
    turns: list[Turn]  # never mutated: every change builds a new list
    size: int


def turn_size(turn: Turn) -> int:
    """What a turn costs in memory, roughly: its replay items' bytes plus its two messages."""
    items = sum(len(item) for item in turn.replay_items)
    return items + len(turn.user_message) + len(turn.assistant_message)


class CachedStore:
    """The ConversationStore port over ``inner``, remembering up to ``max_bytes`` of turns
    (0 switches caching off: every call goes straight through)."""

    def __init__(self, inner: ConversationStore, max_bytes: int) -> None:
        self._inner = inner
        self._max_bytes = max_bytes
        self._entries: OrderedDict[UUID, _Entry] = OrderedDict()
        self._bytes = 0

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def cached_revision(self, conversation_id: UUID) -> int | None:
        entry = self._entries.get(conversation_id)
        return entry.revision if entry else None

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        if after_revision:  # a few recent turns: not what this cache is for
            return await self._inner.load(conversation_id, owner, after_revision=after_revision)
        entry = self._entries.get(conversation_id)
        after = entry.revision if entry else 0
        fresh = await self._inner.load(conversation_id, owner, after_revision=after)
        return await self._merged(conversation_id, owner, entry, fresh)

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        """The lease, revalidating the cached turns in the same statement."""
        entry = self._entries.get(ask.conversation_id)
        attempt = await self._inner.lease(
            replace(ask, after_revision=entry.revision if entry else 0)
        )
        if attempt.crowded:  # nothing was read
            return attempt
        merged = await self._merged(ask.conversation_id, ask.owner, entry, attempt.conversation)
        return replace(attempt, conversation=merged)

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        await self._inner.release_lease(conversation_id, holder)

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        return await self._inner.renew_leases(leases, lease_s)

    async def take_turn(self, owner: str, holder: UUID, lease_s: float) -> bool:
        return await self._inner.take_turn(owner, holder, lease_s)

    async def free_turn(self, owner: str, holder: UUID) -> None:
        await self._inner.free_turn(owner, holder)

    async def renew_turns(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> None:
        await self._inner.renew_turns(turns, lease_s)

    async def _merged(
        self,
        conversation_id: UUID,
        owner: str,
        entry: _Entry | None,
        fresh: Conversation | None,
    ) -> Conversation | None:
        """``fresh`` (the turns after the cached revision) with the cached turns before it."""
        if fresh is None:
            self._evict(conversation_id)
            return None
        if entry is not None and not _continues(entry, fresh):
            # The id names another conversation now, or rows are missing: start over.
            self._evict(conversation_id)
            entry = None
            fresh = await self._inner.load(conversation_id, owner)
            if fresh is None:
                return None
        if entry is None:
            turns, size = fresh.turns, sum(map(turn_size, fresh.turns))
        else:
            turns = [*entry.turns, *fresh.turns] if fresh.turns else entry.turns
            size = entry.size + sum(map(turn_size, fresh.turns))
        self._remember(conversation_id, _Entry(fresh.revision, fresh.created_at, turns, size))
        # Every conversation-level field comes from the row just read; the copy of the list
        # keeps a caller from changing what is cached.
        return replace(fresh, turns=list(turns))

    async def append(self, append: Append) -> Commit:
        conversation_id, turn, expected_revision = (
            append.conversation_id, append.turn, append.expected_revision
        )  # fmt: skip
        try:
            commit = await self._inner.append(append)
        except BaseException:
            # Conflict, not found, storage error or cancellation: the next load reads afresh.
            self._evict(conversation_id)
            raise
        # The commit made revision expected + 1 out of exactly the cached turns plus this one.
        turn = replace(turn, created_at=commit.updated_at)  # the commit's now(), as stored
        entry = self._entries.get(conversation_id)
        if commit.revision != expected_revision + 1:
            self._evict(conversation_id)
        elif expected_revision == 0:
            self._remember(conversation_id, _Entry(1, commit.created_at, [turn], turn_size(turn)))
        elif entry is not None and entry.revision == expected_revision:
            turns, size = [*entry.turns, turn], entry.size + turn_size(turn)
            self._remember(conversation_id, _Entry(commit.revision, entry.created_at, turns, size))
        return commit

    async def transcript(
        self, conversation_id: UUID, owner: str, page: PageRequest
    ) -> TranscriptPage | None:
        return await self._inner.transcript(conversation_id, owner, page)  # a page: not cached

    async def delete(
        self, conversation_id: UUID, owner: str = ANONYMOUS, if_match: Precondition = None
    ) -> None:
        try:
            await self._inner.delete(conversation_id, owner, if_match)
        finally:
            # Also after a failed delete: a load racing with it may have cached what is gone.
            self._evict(conversation_id)

    async def turn(self, conversation_id: UUID, owner: str, revision: int) -> Turn | None:
        return await self._inner.turn(conversation_id, owner, revision)  # one turn: not cached

    async def turns(
        self, conversation_id: UUID, owner: str, low: int, high: int, *, newest_first: bool,
        limit: int,
    ) -> list[tuple[int, Turn]]:  # fmt: skip
        return await self._inner.turns(  # a page: not cached
            conversation_id, owner, low, high, newest_first=newest_first, limit=limit
        )

    async def delete_response(self, conversation_id: UUID, owner: str, revision: int) -> bool:
        # Cached turns may keep saying their response is there: nothing reads that from here
        # (a response is read with after_revision, which this cache passes through).
        return await self._inner.delete_response(conversation_id, owner, revision)

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None
    ) -> tuple[list[Summary], str | None]:
        return await self._inner.list_conversations(owner, limit, after)

    async def create_conversation(
        self, owner: str, metadata: dict[str, str], turn: Turn | None = None
    ) -> ConversationInfo:
        return await self._inner.create_conversation(owner, metadata, turn)

    async def fork(self, conversation_id: UUID, owner: str, at_revision: int) -> ConversationInfo:
        return await self._inner.fork(conversation_id, owner, at_revision)

    async def pop_item(
        self, conversation_id: UUID, owner: str, if_match: Precondition = None
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        self._evict(conversation_id)
        try:
            return await self._inner.pop_item(conversation_id, owner, if_match)
        finally:
            self._evict(conversation_id)

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        return await self._inner.describe(conversation_id, owner)

    async def update_metadata(
        self, conversation_id: UUID, owner: str, metadata: Metadata, if_match: Precondition = None
    ) -> ConversationInfo:
        return await self._inner.update_metadata(conversation_id, owner, metadata, if_match)

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0
        await self._inner.close()

    def _remember(self, conversation_id: UUID, entry: _Entry) -> None:
        current = self._entries.get(conversation_id)
        if current is not None and current.revision > entry.revision:
            # A concurrent load or append got further meanwhile; keep the newer one.
            self._entries.move_to_end(conversation_id)
            return
        self._evict(conversation_id)
        if self._max_bytes <= 0 or entry.size > self._max_bytes:
            return  # caching is off, or this alone is larger than the whole cache
        self._entries[conversation_id] = entry
        self._bytes += entry.size
        while self._bytes > self._max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size

    def _evict(self, conversation_id: UUID) -> None:
        entry = self._entries.pop(conversation_id, None)
        if entry is not None:
            self._bytes -= entry.size


def _continues(entry: _Entry, fresh: Conversation) -> bool:
    """Whether ``fresh`` (the turns after entry.revision) extends the cached turns."""
    return (
        fresh.created_at == entry.created_at
        and fresh.revision == entry.revision + len(fresh.turns)
        and fresh.rewritten_at <= entry.revision  # no turn it holds was rewritten since
    )
