"""A replica-local history cache in front of the PostgreSQL store.

Every load still asks the database, in one query, for the conversation row and only the turns
committed after the revision cached here: nothing more when the cache is current, a few rows
when another replica committed meanwhile. This is correct because committed turns never
change and only disappear together with their conversation; the conversation row itself is
always read fresh, so its revision, timestamps and any other conversation-level field are
never served from memory. Only turns are cached, bounded by their bytes, least recently used
out first. Nothing here changes what clients see.

What is cached of a conversation is a suffix of its turns: a turn reads (and this keeps) its
window, from the committed window start on, never the whole history; a whole read (``load``)
keeps them all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar
from uuid import UUID

from service.core.model import (
    ANONYMOUS,
    Append,
    Commit,
    Conversation,
    LeaseAttempt,
    LeaseRequest,
    Removal,
    Turn,
    since,
)
from service.core.sizes import turn_bytes
from service.store.ports import History

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class _Entry:
    revision: int
    created_at: datetime  # tells a conversation from a later one that reuses its id
    first: int  # every turn of revision first..revision is cached
    turns: list[Turn]  # never mutated: every change builds a new list
    size: int

    def since(self, start: int) -> list[Turn] | None:
        """The cached turns of revision ``start`` on (None: not all of them are cached)."""
        return since(self.turns, start) if self.first <= start else None


def turn_size(turn: Turn) -> int:
    """What a turn costs in memory, roughly: what it stores (service/core/sizes.py), every
    field of it this cache keeps counted."""
    return turn_bytes(turn)


class CachedStore:
    """The History port over ``inner``, remembering up to ``max_bytes`` of turns (0 switches
    caching off: every call goes straight through). The other ports pass it by: the wiring
    hands them to their callers as the backend made them."""

    def __init__(self, inner: History, max_bytes: int) -> None:
        self._inner = inner
        self._max_bytes = max_bytes
        self._entries: OrderedDict[UUID, _Entry] = OrderedDict()
        self._bytes = 0
        # The writes that take committed content away pass through, the conversation forgotten
        # around each (each names it in its Removal, first).
        self.delete = self._forgetting(inner.delete)
        self.pop_item = self._forgetting(inner.pop_item)
        self.delete_response = self._forgetting(inner.delete_response)

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
        entry = entry if entry is not None and entry.first == 1 else None  # a whole read
        after = entry.revision if entry else 0
        fresh = await self._inner.load(conversation_id, owner, after_revision=after)
        merged = self._merged(conversation_id, entry, fresh, 1)
        if merged is False:  # the id names another conversation now, or rows are missing
            fresh = await self._inner.load(conversation_id, owner)
            merged = self._merged(conversation_id, None, fresh, 1)
        return fresh if merged is False else merged  # (read whole: as it is, not kept)

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        """The lease, revalidating the cached turns in the same statement; the turns of its
        window (from the committed window start on)."""
        cid = ask.conversation_id
        entry = self._entries.get(cid)
        attempt = await self._inner.lease(
            replace(ask, after_revision=entry.revision if entry else 0)
        )
        if attempt.crowded:  # nothing was read
            return attempt
        after = entry.revision if entry else 0
        merged = self._merged(cid, entry, attempt.conversation, _window_start(attempt, after))
        if merged is False:
            # The cached turns do not continue these: the same try again, its window whole
            # (the same holder: its place among the running turns is not taken twice).
            attempt = await self._inner.lease(replace(ask, after_revision=0))
            merged = self._merged(cid, None, attempt.conversation, _window_start(attempt, 0))
        if merged is False:  # (read from its window start: as it is, not kept)
            return attempt
        return replace(attempt, conversation=merged)  # (a copy field by field would drop a new one)

    def _merged(
        self, conversation_id: UUID, entry: _Entry | None, fresh: Conversation | None, since: int
    ) -> Conversation | Literal[False] | None:
        """``fresh`` (the turns after the cached revision, or from ``since`` on if that is
        later) with the cached turns before it, from revision ``since`` on; remembered. False
        (and forgotten) when the cached turns cannot be used with it: read again, without."""
        if fresh is None:
            self._evict(conversation_id)
            return None
        turns = _joined(entry, fresh, since)
        if turns is None:
            self._evict(conversation_id)
            return False
        self._remember(
            conversation_id,
            _Entry(fresh.revision, fresh.created_at, since, turns, _size(entry, turns)),
        )
        # Every conversation-level field comes from the row just read; the copy of the list
        # keeps a caller from changing what is cached.
        return replace(fresh, turns=list(turns), first=since)

    async def append(self, append: Append) -> Commit:
        conversation_id, turn, expected_revision = (
            append.conversation_id,
            append.turn,
            append.expected_revision,
        )
        try:
            commit = await self._inner.append(append)
        except BaseException:
            # Conflict, not found, storage error or cancellation: the next load reads afresh.
            self._evict(conversation_id)
            raise
        # The commit made revision expected + 1 out of exactly the cached turns plus this one.
        # The commit's now() and revision, as stored; without the echo of its /v1 request,
        # which no turn reads of its window (statements.WINDOW_TURN).
        turn = replace(turn, created_at=commit.updated_at, number=commit.revision, response=None)
        entry = self._entries.get(conversation_id)
        if commit.revision != expected_revision + 1:
            self._evict(conversation_id)
        elif expected_revision == 0:
            self._remember(
                conversation_id, _Entry(1, commit.created_at, 1, [turn], turn_size(turn))
            )
        elif entry is not None and entry.revision == expected_revision:
            # Kept from the new turn's window start on: later turns never start before it.
            first = max(entry.first, min(turn.context_from, commit.revision))
            turns = since([*entry.turns, turn], first)
            self._remember(
                conversation_id,
                _Entry(commit.revision, entry.created_at, first, turns, _size(entry, turns)),
            )
        return commit

    def _forgetting(
        self, write: Callable[Concatenate[Removal, P], Awaitable[R]]
    ) -> Callable[Concatenate[Removal, P], Coroutine[Any, Any, R]]:
        """``write``, forgetting its conversation before it (nothing of it is served from here
        meanwhile) and after it, failed too (a load racing it may have kept what is gone)."""

        async def forgetting(removal: Removal, /, *args: P.args, **kwargs: P.kwargs) -> R:
            self._evict(removal.conversation_id)
            try:
                return await write(removal, *args, **kwargs)
            finally:
                self._evict(removal.conversation_id)

        return forgetting

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


def _size(entry: _Entry | None, turns: list[Turn]) -> int:
    """What ``turns`` cost (``turn_size``): only those after the cached ones counted, when
    they begin with all of ``entry``'s (turns read or committed after them, as at most
    turns: a window's turns are counted once, not again at every turn)."""
    if entry is not None and entry.turns and len(turns) >= len(entry.turns):
        last = len(entry.turns) - 1
        if turns[0] is entry.turns[0] and turns[last] is entry.turns[last]:
            return entry.size + sum(map(turn_size, turns[last + 1 :]))
    return sum(map(turn_size, turns))


def _window_start(attempt: LeaseAttempt, after: int) -> int:
    """The first revision of the turns a turn's read holds (those of its window): from the
    window start, or from where the read stopped going back (LeaseRequest.window_bytes), when
    it did stop before what the cache holds."""
    conversation = attempt.conversation
    if conversation is None:
        return 1
    cut = conversation.first if conversation.first > after + 1 else 0
    return max(conversation.context_start, cut)


def _joined(entry: _Entry | None, fresh: Conversation, since: int) -> list[Turn] | None:
    """The turns from revision ``since`` on: ``fresh``'s (read from revision
    ``fresh.first``), after the cached ones before them; None when ``fresh`` is not whole or
    the cached turns cannot give what it lacks (the id names another conversation now, or
    a turn they hold was rewritten since)."""
    if not fresh.complete or fresh.first < since:
        return None
    if fresh.first == since:  # read from ``since`` on: nothing cached is needed
        return fresh.turns
    if (
        entry is None
        or fresh.created_at != entry.created_at
        or fresh.first != entry.revision + 1
        or fresh.rewritten_at > entry.revision  # a turn it holds was rewritten since
    ):
        return None
    cached = entry.since(since)
    if cached is None:
        return None
    return [*cached, *fresh.turns] if fresh.turns else cached
