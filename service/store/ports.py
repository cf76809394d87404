"""The store ports, each what one kind of caller needs. Every adapter raises only the domain
errors named here.

Conversations: ``Reads`` (what readers ask, besides whole histories), ``History`` (the turns,
read whole or changed: what the history cache wraps), ``Edits`` (new conversations, forks,
metadata) and ``Places`` (the leases and places a running turn holds). Durable turns:
``RunWrites`` and ``RunReads``. ``IdempotencyStore`` keeps Idempotency-Key claims (completed
inside each write's own transaction, see History.append); ``Operations`` is for operators and
probes, not for the domain. ``Stores`` and ``Backend`` carry one backend's ports to the wiring.
The owner rule lives in the adapters' queries: a conversation of another owner is never
returned, exactly like one that does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol, runtime_checkable
from uuid import UUID

import msgspec

from service.core.events import RunEvent
from service.core.export_lines import Imported
from service.core.model import (
    ANONYMOUS,
    Append,
    Commit,
    Committed,
    Conversation,
    ConversationInfo,
    IdempotencyKey,
    LeaseAttempt,
    LeaseRequest,
    Metadata,
    NewRun,
    PageRequest,
    Precondition,
    Removal,
    Renewed,
    RunEnd,
    RunView,
    Summary,
    TranscriptPage,
    Turn,
)
from service.core.search import Finding
from service.core.usage import UsageTotal


class Reads(Protocol):
    """What readers ask of conversations besides their whole history: the conversation
    without its turns, the owner's listing, a transcript page, single turns, pages of turns
    and their sizes. Each reads what it returns, no more; the history cache holds none of it."""

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        """The conversation without its turns; None as for History.load. Raises StorageError."""

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None, finding: Finding | None = None
    ) -> tuple[list[Summary], str | None]:
        """A page of the owner's conversations that ``finding`` asks for (None: all), newest
        first, and the next page's cursor; each filter served by an index. Raises InvalidInput
        for a cursor this store did not make."""

    async def usage(
        self, owner: str, since: datetime, until: datetime, group_by: str
    ) -> list[UsageTotal]:
        """What the owner's committed turns from ``since`` to ``until`` cost, summed by
        ``group_by`` (day, model, conversation), ordered by key. Raises StorageError."""

    async def transcript(
        self, conversation_id: UUID, owner: str, page: PageRequest
    ) -> TranscriptPage | None:
        """A page of ``owner``'s conversation's transcript, reading no more than the page
        (nor any replay item); None as for History.load. Raises StorageError."""

    async def turn(self, conversation_id: UUID, owner: str, revision: int) -> Turn | None:
        """The turn that made ``revision`` of ``owner``'s conversation, read alone; None as
        for History.load, or when there is no such turn. Raises StorageError."""

    async def turns(
        self,
        conversation_id: UUID,
        owner: str,
        low: int,
        high: int,
        *,
        newest_first: bool,
        limit: int,
    ) -> list[tuple[int, Turn]]:
        """At most ``limit`` of its turns with revisions ``low``..``high``, each with its
        revision, oldest or newest first (a paged read: memory bounded by the page); none
        for a conversation History.load would not find. Raises StorageError."""

    async def turn_sizes(
        self, conversation_id: UUID, owner: str, low: int, high: int
    ) -> list[tuple[int, int | None]]:
        """What each of its turns ``low``..``high`` holds (service/core/sizes.py), with its
        revision, oldest first, without reading their items into memory; None for a turn
        the database cannot measure (sealed: read it to count it). Raises StorageError."""


class History(Protocol):
    """A conversation's committed turns, read whole or changed: a turn's way (``lease``, which
    reads its window, and ``append``, its commit), the whole read (``load``) and the writes
    that take committed content away (``delete``, ``pop_item``, ``delete_response``). The
    history cache (service/store/cache.py) wraps this port, and only this one. A write that
    came with an Idempotency-Key (``Removal.idempotency``, ``Append.idempotency``) completes
    its claim in its own transaction (IdempotencyStore)."""

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        """``owner``'s conversation with its committed turns after ``after_revision`` (0: all
        of them), in order; None when it is unknown, deleted, expired or another owner's.
        Raises StorageError."""

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        """Take the lease ``ask`` asks for, and load the conversation (as ``load``) in the
        same statement; a queued caller is woken through ``Notifications``. The holder's
        place among its owner's running turns (Places.take_turn) is taken with it, and the lease
        is not when there is none (``crowded``). Raises StorageError."""

    async def append(self, append: Append) -> Commit:
        """Commit the turn in one transaction (see ``Append``); a completed Idempotency-Key
        then names this commit. Raises ConversationConflict (nothing written) when another
        writer got there first, ConversationNotFound when it was deleted or expired meanwhile,
        StorageError."""

    async def delete(self, removal: Removal, if_match: Precondition = None) -> None:
        """Remove the owner's conversation and everything of it (its Idempotency-Key records
        too), if its revision is in ``if_match``; the removal's ``idempotency`` then names the
        deletion. Raises ConversationNotFound, PreconditionFailed, StorageError."""

    async def pop_item(
        self, removal: Removal, if_match: Precondition = None
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        """Remove the conversation's latest item: its last turn, without it
        (core.items.without_last_item), becomes the next revision (a commit; ``rewritten_at`` tells
        readers that hold history to read afresh). The removed item. Raises
        ConversationNotFound, PreconditionFailed, ConversationConflict (a turn is running),
        InvalidInput (nothing to remove), StorageError."""

    async def delete_response(
        self, removal: Removal, revision: int, *, erase: bool = False
    ) -> bool:
        """Forget the response the turn of ``revision`` made (it stays a turn, with its
        items); with ``erase``, the latest turn's content goes too (its texts, items and
        transcript: a stored response's that no later turn holds as its history). Whether
        there was such a response not deleted before (or, with ``erase``, such a latest
        turn)."""


class Edits(Protocol):
    """The writes that make a conversation, or change what is not a turn: a new one (with its
    first turn, or empty), a fork, its metadata. Each completes its Idempotency-Key claim in
    its own transaction, as History's writes do."""

    async def create_conversation(
        self,
        owner: str,
        metadata: dict[str, str],
        turn: Turn | None = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        """A new conversation of ``owner``'s: with ``turn`` (items appended without the
        model) as its first commit, else empty at revision 0. Raises OwnerShredded,
        StorageError."""

    async def import_conversation(
        self, owner: str, imported: Imported, idempotency: IdempotencyKey | None = None
    ) -> ConversationInfo:
        """A new conversation of ``owner``'s holding ``imported``'s turns as they are (revisions,
        replay bytes, origins, window starts, times), at its revision, in one transaction.
        Raises OwnerShredded, StorageError."""

    async def fork(
        self,
        conversation_id: UUID,
        owner: str,
        at_revision: int,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        """A new conversation of ``owner``'s holding turns 1..``at_revision`` of this one, as
        they are (replay bytes, origins, window starts); this one is untouched. Raises
        ConversationNotFound, InvalidInput (no such revision), StorageError."""

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: Metadata,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        """Replace its metadata (no commit: the revision stays), if its revision is in
        ``if_match``. Raises ConversationNotFound, PreconditionFailed, StorageError."""


class Places(Protocol):
    """What a turn holds while it runs, besides what it reads: the lease on its conversation
    (taken with its window read, History.lease; released by its commit, History.append), its
    place among its owner's running turns, and the place of the fork it makes among its
    owner's forks of the minute. Counted across every replica; a replica that dies leaves
    leases and places that run out by themselves."""

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        """Give the lease up (a turn that will not commit; a commit releases it by itself)."""

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        """Extend these (conversation, holder) leases by ``lease_s`` from now; the
        conversations whose lease was still this holder's."""

    async def take_turn(self, owner: str, holder: UUID, lease_s: float) -> bool:
        """A place among ``owner``'s running turns for ``holder`` (OWNER_MAX_RUNNING_TURNS,
        counted across every replica) for ``lease_s`` from now; False when the owner runs
        that many already. A holder that has one keeps it (renewed). History.lease takes
        it too, and History.append gives it back. Raises StorageError."""

    async def free_turn(self, owner: str, holder: UUID) -> None:
        """Give the place back (a turn that ends without its commit). Raises StorageError."""

    async def renew_turns(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> None:
        """Extend these (owner, holder) places by ``lease_s`` from now."""

    async def take_fork(self, owner: str, conversation_id: UUID) -> None:
        """A place for the fork ``conversation_id`` among ``owner``'s forks of the last minute
        (OWNER_MAX_FORKS_PER_MINUTE, fleet-wide), taken before a turn that makes it calls the
        provider (its commit makes the fork, ``Append.fork_of``); Edits.fork takes its own.
        Raises TooManyRequests, StorageError."""

    async def free_fork(self, owner: str, conversation_id: UUID) -> None:
        """Give the place back: the turn that was to make the fork did not commit."""


class RunWrites(Protocol):
    """Durable turns (service/usecases/runs.py): what changes a run, its status and the events
    its client saw. The commit of a durable turn ends its run in the same transaction
    (``Append.run``)."""

    async def create_run(self, run: NewRun, heartbeat_s: float, *, counted: bool = True) -> bool:
        """Record a new run, queued, alive for ``heartbeat_s``, and (``counted``) its turn's
        place among its owner's running turns (as Places.take_turn, held by the run's
        id); False, and nothing recorded, when the owner runs OWNER_MAX_RUNNING_TURNS turns.
        A run that names its conversation ``existing`` is recorded only if the owner has it,
        at a revision ``if_match`` lists: ConversationNotFound, PreconditionFailed before its
        place is taken."""

    async def begin_run(self, run_id: UUID, revision: int) -> None:
        """The run's turn holds its conversation at ``revision``: it is in progress."""

    async def log_events(
        self, run_id: UUID, owner: str, events: Sequence[RunEvent], message_id: str | None = None
    ) -> None:
        """Append events of ``owner``'s run (in progress from its first), and the id of the
        message it streams if not known yet; wakes its watchers."""

    async def end_run(self, run_id: UUID, owner: str, end: RunEnd) -> bool:
        """End an unfinished run that did not commit, with its last events; False when it had
        ended already (committed, cancelled elsewhere, interrupted)."""

    async def renew_runs(self, run_ids: Sequence[UUID], heartbeat_s: float) -> Renewed:
        """Keep these runs alive for ``heartbeat_s``; those asked to stop or watched."""

    async def cancel_run(self, run_id: UUID, owner: str) -> bool:
        """Ask ``owner``'s unfinished run to stop (its replica hears of it); whether it was
        unfinished."""

    async def watch_run(self, run_id: UUID) -> None:
        """A reader follows the run from elsewhere: its events must wake readers, and its
        replica (notified) must log them at once."""

    async def interrupt_run(self, run_id: UUID, owner: str, message: str, event_data: str) -> bool:
        """End ``owner``'s run whose replica stopped renewing it: failed, turn_interrupted,
        with this terminal ``error`` event; False when it is alive or ended."""

    async def forget_run(self, run_id: UUID, owner: str) -> None:
        """Remove ``owner``'s finished run and its events (an unfinished one stays)."""


class RunReads(Protocol):
    """Durable turns, read: a run's status, its events, the run of a revision, which of this
    replica's runs were asked to stop."""

    async def read_run(
        self, run_id: UUID, owner: str, conversation_id: UUID | None = None
    ) -> RunView | None:
        """``owner``'s run, with its committed reply; None when unknown, another owner's, of
        another conversation than ``conversation_id`` (when the caller knows it: a stored
        response's id carries it), or its events expired."""

    async def run_events(
        self, run_id: UUID, owner: str, after: int
    ) -> tuple[RunView, list[RunEvent]] | None:
        """The run (without its reply) and its events after ``after``, in one read."""

    async def find_run(self, conversation_id: UUID, owner: str, base_revision: int) -> UUID | None:
        """The run (the latest) whose turn held ``owner``'s conversation at ``base_revision``:
        the one that makes, or made, revision ``base_revision + 1``."""

    async def cancel_requested(self, run_ids: Sequence[UUID]) -> set[UUID]:
        """Those of these runs asked to stop (read only)."""


class IdempotencyStore(Protocol):
    """Idempotency-Key claims (service/usecases/write_gate.py). A write that claimed one
    completes it in its own transaction: ``Append.idempotency``, and the ``idempotency`` of
    every other write of History and Edits."""

    async def claim(self, key: IdempotencyKey, turn_id: UUID | None = None) -> Committed | None:
        """Claim ``key`` for a new attempt (None), held for a lease (see ``renew``), or say
        where the first attempt committed. Raises RequestInProgress while that attempt runs
        (with its ``turn_id``, the run of a background turn), IdempotencyKeyReused when the
        key came with another request."""

    async def check(self, key: IdempotencyKey) -> None:
        """Raise now what ``claim`` would raise, without claiming (a stream reports these as
        JSON errors before it starts; ``claim`` still decides races)."""

    async def release(self, key: IdempotencyKey, *, in_doubt: bool = True) -> None:
        """A failed attempt does not use the key up. ``in_doubt``: it failed where its write
        may have committed all the same (a storage failure, a cancellation); a store whose
        write and key commit apart (Citus: receipts.py) then settles the key at its next claim
        instead of freeing it now."""

    async def release_run(self, turn_id: UUID, owner: str) -> None:
        """The key a run claimed, if it still says 'running': the run ended without a commit
        (its replica vanished), so a retry may run the turn again at once."""

    async def renew(self, keys: Sequence[IdempotencyKey], lease_s: float) -> None:
        """Keep these claims (still running) for ``lease_s`` from now: a claim that is not
        renewed is taken over once its lease runs out (its replica died)."""


@dataclass(frozen=True)
class Readiness:
    schema: str | None  # the migration revision the database is at (None: not migrated)
    writable: bool  # False while the server is in recovery or sessions are read-only
    keyring: bool = True  # with encryption: its keyring is reachable and migrated


@runtime_checkable
class Operations(Protocol):
    async def readiness(self) -> Readiness:
        """What /readyz reports on. Raises StorageError when the database is unreachable."""

    def pool_in_use(self) -> int:
        """Database connections this process has checked out now (for /metrics)."""

    async def purge(self, batch: int = 500) -> int:
        """Delete what has expired (conversations past the retention, Idempotency-Key
        records past their TTL); the number of conversations deleted."""


class ApiKeys(Protocol):
    async def owner_of(self, key: str) -> str | None:
        """The owner of a live API key; None for anything else (unknown, revoked, garbage)."""


class Notifications(Protocol):
    """Wake-ups between replicas: a holder releasing a lease, a turn's new events. Only a hint
    to look again: a waiter also looks by itself after a bounded time, since a notification
    can be lost (a listener reconnecting, a replica dying)."""

    def subscribe(self, topic: str) -> AbstractAsyncContextManager[asyncio.Event]:
        """An event set whenever ``topic`` is notified while inside (clear it to wait again)."""

    @property
    def healthy(self) -> bool:
        """Whether notifications arrive now; if not, waiters look again sooner."""


Closer = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Stores:
    """One backend's store ports (one object may keep several: the in-memory fake keeps them
    all). The wiring hands each use case the ones it uses."""

    reads: Reads
    history: History
    edits: Edits
    places: Places
    run_writes: RunWrites
    run_reads: RunReads
    idempotency: IdempotencyStore | None = None


@dataclass
class Backend:
    """Where a deployment keeps its state, as the use cases see it: every port, and what to
    close at shutdown (in reverse order). The wiring builds PostgreSQL's (service/app.py);
    tests may hand in another that keeps the same contracts."""

    stores: Stores
    notifications: Notifications
    ops: Operations
    api_keys: ApiKeys | None = None
    closers: list[Closer] = field(default_factory=list)
    # Reads the deployment's ``ids`` secret (the same on every replica: service/core/ids.py);
    # None: a random one for this process alone (a backend only this process reads).
    ids_secret: Callable[[], Awaitable[bytes]] | None = None
