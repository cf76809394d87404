"""A fake of the store ports, in memory, that keeps the same contracts as the PostgreSQL adapter.

For the fast layer of tests (the turn rules in milliseconds) and nothing else: one process,
no durability. ``tests/contracts/store.py`` runs the same contract tests against both stores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from uuid import UUID, uuid4

import msgspec

from service.core import events
from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    IdempotencyKeyReused,
    InvalidInput,
    RequestInProgress,
    TooManyRequests,
    TurnInterrupted,
)
from service.core.events import RunEvent
from service.core.export_lines import Imported
from service.core.items import without_last_item
from service.core.model import (
    ANONYMOUS,
    FINISHED,
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
    RunStatus,
    RunView,
    Summary,
    TranscriptPage,
    TranscriptTurn,
    Turn,
    since,
)
from service.core.plans import check_precondition
from service.core.search import MODEL, PAIR, Finding, clear_term, pair_value, turn_text, words
from service.core.sizes import held_bytes, turn_bytes
from service.core.usage import Usage, UsageTotal
from service.platform.migrate import head_revision
from service.store.cursor import decode_cursor, encode_cursor
from service.store.pages import fitting, page_of
from service.store.ports import Readiness
from service.store.subscribers import Subscribers


@dataclass
class _Key:
    request_hash: str
    expires_at: datetime
    committed: Committed | None = None  # None while the first attempt runs
    turn_id: UUID | None = None
    claim: UUID | None = None  # the attempt that holds it


@dataclass
class _Run:
    new: NewRun
    heartbeat_until: datetime
    status: RunStatus = "queued"
    revision: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    events: list[RunEvent] = field(default_factory=list)
    cancel_requested: bool = False
    watched: bool = False
    expires_at: datetime | None = None
    base_revision: int | None = None
    message_id: str | None = None
    created_at: datetime = field(default_factory=lambda: _now())

    def view(self, message: str | None = None) -> RunView:
        return RunView(
            id=self.new.id,
            conversation_id=self.new.conversation_id,
            status=self.status,
            revision=self.revision,
            message=message,
            error_code=self.error_code,
            error_message=self.error_message,
            last_event=self.events[-1].seq if self.events else 0,
            background=self.new.background,
            stalled=not self.finished and self.heartbeat_until < _now(),
            base_revision=self.base_revision,
            message_id=self.message_id,
            response=self.new.response,
            created_at=self.created_at,
        )

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass
class _Conversation:
    row: Conversation
    turns: list[Turn] = field(default_factory=list)
    holder: UUID | None = None  # the turn lease
    lease_expires_at: datetime | None = None
    lease_wanted: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    expires_at: datetime | None = None  # a stored response's conversation's
    forked_from: UUID | None = None

    def info(self) -> ConversationInfo:
        row = self.row
        return ConversationInfo(
            row.id, row.revision, row.created_at, row.updated_at, self.metadata,
            self.expires_at is not None, held_bytes(self.turns), row.revision,
            context_start=row.context_start, forked_from=self.forked_from,
        )  # fmt: skip

    def terms(self) -> set[str]:
        """What it is found by (service/core/search.py), as the database keeps it in clear."""
        found = {clear_term(PAIR, pair_value(k, v)) for k, v in self.metadata.items()}
        for turn in self.turns:
            found.update(words(turn_text(turn)))
            if turn.origin is not None:
                found.add(clear_term(MODEL, turn.origin.model))
        return found

    def head(self) -> Conversation:
        """The conversation row as read, its size counted (as every commit here keeps it)."""
        return replace(
            self.row, stored_bytes=held_bytes(self.turns), stored_revision=self.row.revision
        )

    def at(self, revision: int) -> int | None:
        """Where the turn of ``revision`` is (None: there is none; revisions have gaps)."""
        return next((i for i, t in enumerate(self.turns) if t.number == revision), None)

    def lease_free_for(self, holder: UUID | None, now: datetime) -> bool:
        expired = self.lease_expires_at is None or self.lease_expires_at <= now
        return self.holder is None or expired or self.holder == holder


class LocalNotifications(Subscribers):
    """Notifications within one process (the in-memory store's, and a test's)."""


class MemoryStore:
    """Every store port (service/store/ports.py) and Operations, in a dict: one object for
    all of them, each port's name this object (as PostgresStore names its class of it)."""

    def __init__(
        self,
        *,
        retention_days: float | None = None,
        idempotency_ttl_s: float = 86_400,
        idempotency_lease_s: float = 600,
        events_ttl_s: float = 600,
        stored_response_ttl_s: float = 30 * 86_400,
        notifications: LocalNotifications | None = None,
        forks_per_minute: int | None = None,
        running_turns: int | None = None,
    ) -> None:
        self.notifications = notifications or LocalNotifications()
        self.reads = self.history = self.edits = self.places = self
        self.run_writes = self.run_reads = self.idempotency = self.ops = self
        self._running_turns = running_turns
        self._running: dict[str, dict[UUID, datetime]] = {}  # owner -> holder -> until
        self._forks_per_minute = forks_per_minute
        self._forks: dict[str, list[tuple[datetime, UUID]]] = {}  # each owner's forks of the minute
        self._conversations: dict[UUID, _Conversation] = {}
        self._runs: dict[UUID, _Run] = {}
        self._events_ttl = timedelta(seconds=events_ttl_s)
        self._keys: dict[tuple[str, str], _Key] = {}
        self._retention = timedelta(days=retention_days) if retention_days else None
        self._ttl = timedelta(seconds=idempotency_ttl_s)
        self._lease = timedelta(seconds=idempotency_lease_s)
        self._stored_ttl = timedelta(seconds=stored_response_ttl_s)

    def _live(self, conversation_id: UUID, owner: str) -> _Conversation | None:
        found = self._conversations.get(conversation_id)
        if found is None or found.row.owner != owner:
            return None
        if self._gone(found, _now()):
            return None
        return found

    def _gone(self, found: _Conversation, now: datetime) -> bool:
        if found.expires_at is not None and found.expires_at <= now:
            return True
        return self._retention is not None and found.row.updated_at <= now - self._retention

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        found = self._live(conversation_id, owner)
        if found is None:
            return None
        return replace(
            found.head(), turns=since(found.turns, after_revision + 1), first=after_revision + 1
        )

    async def turn(self, conversation_id: UUID, owner: str, revision: int) -> Turn | None:
        found = self._live(conversation_id, owner)
        at = found.at(revision) if found else None
        return None if found is None or at is None else found.turns[at]

    async def turns(
        self, conversation_id: UUID, owner: str, low: int, high: int, *, newest_first: bool,
        limit: int,
    ) -> list[tuple[int, Turn]]:  # fmt: skip
        found = self._live(conversation_id, owner)
        if found is None:
            return []
        numbered = [(t.number or 0, t) for t in found.turns if low <= (t.number or 0) <= high]
        return (numbered[::-1] if newest_first else numbered)[:limit]

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        found = self._live(ask.conversation_id, ask.owner)
        if found is None:
            return LeaseAttempt(conversation=None, acquired=False)
        now, holder = _now(), ask.holder
        # A turn reads its window: from the committed window start on.
        start = max(ask.after_revision + 1, found.row.context_start)
        conversation = replace(found.head(), turns=since(found.turns, start), first=start)
        if found.lease_free_for(holder, now) or (ask.replaces and found.holder == ask.replaces):
            if not await self.take_turn(ask.owner, holder, ask.lease_s):
                return LeaseAttempt(conversation=None, acquired=False, crowded=True)
            found.holder, found.lease_expires_at = holder, now + timedelta(seconds=ask.lease_s)
            found.lease_wanted = False
            if ask.run:
                await self.begin_run(holder, found.row.revision)
            return LeaseAttempt(conversation, acquired=True)
        found.lease_wanted = found.lease_wanted or ask.queue
        return LeaseAttempt(conversation, acquired=False, busy_until=found.lease_expires_at)

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        found = self._conversations.get(conversation_id)
        if found is not None and found.holder == holder:
            self._released(found)

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        renewed = set()
        for conversation_id, holder in leases:
            found = self._conversations.get(conversation_id)
            if found is not None and found.holder == holder:
                found.lease_expires_at = _now() + timedelta(seconds=lease_s)
                renewed.add(conversation_id)
        return renewed

    async def turn_sizes(
        self, conversation_id: UUID, owner: str, low: int, high: int
    ) -> list[tuple[int, int | None]]:
        found = self._live(conversation_id, owner)
        turns = [] if found is None else found.turns
        return [(t.number or 0, turn_bytes(t)) for t in turns if low <= (t.number or 0) <= high]

    async def take_turn(self, owner: str, holder: UUID, lease_s: float) -> bool:
        now, running = _now(), self._running.setdefault(owner, {})
        for other in [h for h, until in running.items() if until <= now]:
            del running[other]
        most = self._running_turns
        if holder not in running and most is not None and len(running) >= most:
            return False
        running[holder] = now + timedelta(seconds=lease_s)
        return True

    async def free_turn(self, owner: str, holder: UUID) -> None:
        self._running.get(owner, {}).pop(holder, None)

    async def renew_turns(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> None:
        for owner, holder in turns:
            if holder in self._running.get(owner, {}):
                self._running[owner][holder] = _now() + timedelta(seconds=lease_s)

    def _released(self, found: _Conversation) -> None:
        found.holder = found.lease_expires_at = None
        if found.lease_wanted:
            self.notifications.notify(f"lease:{found.row.id}")

    async def transcript(
        self, conversation_id: UUID, owner: str, page: PageRequest
    ) -> TranscriptPage | None:
        found = self._live(conversation_id, owner)
        if found is None:
            return None
        before = page.before if page.before is not None else found.row.revision + 1
        numbered = [
            (t.number or 0, t) for t in found.turns if page.after < (t.number or 0) < before
        ]
        ordered = numbered[::-1] if page.backwards else numbered
        sizes = [
            (n, len(t.user_message.encode()) + len(t.assistant_message.encode()))
            for n, t in ordered[: page.limit + 1]
        ]
        chosen = set(fitting(sizes, page))
        turns = [
            TranscriptTurn(
                number=n,
                user_message=t.user_message,
                assistant_message=t.assistant_message,
                context_from=t.context_from,
                prompt_version=t.prompt_version,
                tool_calls=t.tool_calls,
                said=t.transcript,
                usage=t.usage,
                model=t.origin.model if t.origin else None,
            )
            for n, t in numbered
            if n in chosen
        ]
        return page_of(replace(found.row, turns=[]), turns, page, fetched=len(sizes))

    async def append(self, append: Append) -> Commit:
        self._holds(append.idempotency)
        conversation_id, turn, owner = append.conversation_id, append.turn, append.owner
        expected_revision, idempotency = append.expected_revision, append.idempotency
        now = _now()
        if append.lease is not None:  # the turn ends here, committed or not
            await self.free_turn(owner, append.lease)
        if append.fork_of is not None:
            point = append.fork_of
            await self.fork(
                point.source, owner, point.revision, new_id=conversation_id, counted=False
            )
        existing = self._conversations.get(conversation_id)
        if expected_revision == 0 and existing is not None:  # made empty on /v1: revision 0
            usable = self._live(conversation_id, owner) is existing and existing.row.revision == 0
            if not usable or not existing.lease_free_for(append.lease, now):
                raise ConversationConflict()
        elif expected_revision != 0:
            live = self._live(conversation_id, owner)
            if live is None:
                raise ConversationNotFound()
            if live.row.revision != expected_revision or not live.lease_free_for(append.lease, now):
                raise ConversationConflict()
        run = self._runs.get(append.run.run_id) if append.run else None
        if append.run is not None and (run is None or run.finished):
            raise TurnInterrupted()
        if expected_revision == 0 and existing is None:
            row = Conversation(
                id=conversation_id,
                revision=1,
                created_at=now,
                updated_at=now,
                context_start=turn.context_from,
                owner=owner,
            )
            found = self._conversations[conversation_id] = _Conversation(row)
            if append.stored_response:
                found.expires_at = now + self._stored_ttl
        else:
            found = self._conversations[conversation_id]
            found.row = replace(
                found.row,
                revision=expected_revision + 1,
                updated_at=now,
                context_start=max(found.row.context_start, turn.context_from),
            )
            if found.expires_at is not None:
                found.expires_at = now + self._stored_ttl
        found.turns.append(replace(turn, created_at=now, number=found.row.revision))
        self._released(found)
        revision = found.row.revision
        self._completed(idempotency, conversation_id, revision)
        if append.run is not None and run is not None:
            done = append.run.done.event(append.run.done_seq, revision)
            self._end(run, append.run.status, None, None, [done])
            run.revision = revision
        return Commit(revision, found.row.created_at, found.row.updated_at)

    async def create_conversation(
        self,
        owner: str,
        metadata: dict[str, str],
        turn: Turn | None = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        self._holds(idempotency)
        now = _now()
        revision = 0 if turn is None else 1
        row = Conversation(uuid4(), revision, now, now, owner=owner)
        found = self._conversations[row.id] = _Conversation(row, metadata=dict(metadata))
        if turn is not None:
            found.turns.append(replace(turn, created_at=now, number=1))
        self._completed(idempotency, row.id, revision)
        return found.info()

    async def import_conversation(
        self, owner: str, imported: Imported, idempotency: IdempotencyKey | None = None
    ) -> ConversationInfo:
        self._holds(idempotency)
        now = _now()
        row = Conversation(
            uuid4(), imported.revision, now, now, context_start=imported.context_start, owner=owner
        )
        found = _Conversation(row, list(imported.turns), metadata=dict(imported.metadata))
        self._conversations[row.id] = found
        self._completed(idempotency, row.id, imported.revision)
        return found.info()

    async def fork(
        self,
        conversation_id: UUID,
        owner: str,
        at_revision: int,
        idempotency: IdempotencyKey | None = None,
        *,
        new_id: UUID | None = None,
        counted: bool = True,
    ) -> ConversationInfo:
        self._holds(idempotency)
        found = self._live(conversation_id, owner)
        if found is None:
            raise ConversationNotFound()
        if not 1 <= at_revision <= found.row.revision:
            raise InvalidInput("at_revision must be a revision of the conversation.")
        now = _now()
        if counted:
            await self.take_fork(owner, new_id or uuid4())
        turns = [turn for turn in found.turns if (turn.number or 0) <= at_revision]
        start = turns[-1].context_from if turns else 1
        row = Conversation(
            new_id or uuid4(), at_revision, now, now, context_start=start, owner=owner
        )
        fork = self._conversations[row.id] = _Conversation(
            row,
            list(turns),
            metadata=dict(found.metadata),
            expires_at=found.expires_at,
            forked_from=conversation_id,
        )
        self._completed(idempotency, row.id, at_revision)
        return fork.info()

    async def take_fork(self, owner: str, conversation_id: UUID) -> None:
        if self._forks_per_minute is None:
            return
        now = _now()
        recent = [(t, c) for t, c in self._forks.get(owner, []) if t > now - timedelta(minutes=1)]
        if len(recent) >= self._forks_per_minute:
            wait = recent[0][0] + timedelta(minutes=1) - now
            raise TooManyRequests(retry_after=str(max(1, math.ceil(wait.total_seconds()))))
        self._forks[owner] = [*recent, (now, conversation_id)]

    async def free_fork(self, owner: str, conversation_id: UUID) -> None:
        self._forks[owner] = [(t, c) for t, c in self._forks.get(owner, []) if c != conversation_id]

    async def pop_item(
        self, removal: Removal, if_match: Precondition = None
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        conversation_id, owner = removal.conversation_id, removal.owner
        self._holds(removal.idempotency)
        found = self._live(conversation_id, owner)
        if found is None:
            raise ConversationNotFound()
        check_precondition(if_match, found.row.revision)
        now = _now()
        if found.holder is not None and not found.lease_free_for(None, now):
            raise ConversationConflict()
        if not found.turns or not found.turns[-1].replay_items:
            raise InvalidInput("The conversation has no item to remove.", param="item_id")
        last = found.turns[-1]
        revision = found.row.revision + 1  # the turn moves to it, as in PostgreSQL
        found.turns[-1] = replace(without_last_item(last), number=revision)
        found.row = replace(found.row, revision=revision, updated_at=now, rewritten_at=revision)
        self._completed(removal.idempotency, conversation_id, revision)
        return found.info(), last.replay_items[-1]

    async def delete_response(
        self, removal: Removal, revision: int, *, erase: bool = False
    ) -> bool:
        conversation_id, owner = removal.conversation_id, removal.owner
        self._holds(removal.idempotency)
        found = self._live(conversation_id, owner)
        at = found.at(revision) if found else None
        self._completed(removal.idempotency, conversation_id, revision)
        if found is None or at is None:
            return False
        if erase:
            if found.row.revision != revision:
                return False
            erased = Turn("", "", [], found.turns[at].origin, transcript=(), number=revision)
            found.turns[at] = replace(erased, response_deleted=True)
            return True
        if found.turns[at].response_deleted:
            return False
        found.turns[at] = replace(found.turns[at], response_deleted=True)
        return True

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        found = self._live(conversation_id, owner)
        return None if found is None else found.info()

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: Metadata,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        self._holds(idempotency)
        found = self._live(conversation_id, owner)
        if found is None:
            raise ConversationNotFound()
        check_precondition(if_match, found.row.revision)
        found.metadata = dict(metadata)
        self._completed(idempotency, conversation_id, found.row.revision)
        return found.info()

    # --- runs ------------------------------------------------------------------------------

    async def create_run(self, run: NewRun, heartbeat_s: float, *, counted: bool = True) -> bool:
        if run.existing:
            found = self._live(run.conversation_id, run.owner)
            if found is None:
                raise ConversationNotFound()
            check_precondition(run.if_match, found.row.revision)
        if counted and not await self.take_turn(run.owner, run.id, heartbeat_s):
            return False
        self._runs[run.id] = _Run(run, _now() + timedelta(seconds=heartbeat_s))
        return True

    async def begin_run(self, run_id: UUID, revision: int) -> None:
        run = self._runs.get(run_id)
        if run is not None and run.status == "queued":
            run.status, run.base_revision = "in_progress", revision

    async def find_run(self, conversation_id: UUID, owner: str, base_revision: int) -> UUID | None:
        found = [
            run for run in self._runs.values()
            if run.new.conversation_id == conversation_id and run.base_revision == base_revision
            and self._readable(run.new.id, owner) is not None
        ]  # fmt: skip
        ended = ("failed", "cancelled")  # as RUN_AT: a run that did not end so first
        return (
            max(found, key=lambda run: (run.status not in ended, run.created_at)).new.id
            if found
            else None
        )

    async def log_events(
        self, run_id: UUID, owner: str, events: Sequence[RunEvent], message_id: str | None = None
    ) -> None:
        run = self._runs.get(run_id)
        if run is not None and not run.finished:
            run.message_id = run.message_id or message_id
            known = {e.seq for e in run.events}
            run.events += [e for e in events if e.seq not in known]
            run.status = "in_progress"
            self.notifications.notify(f"events:{run_id}")

    async def end_run(self, run_id: UUID, owner: str, end: RunEnd) -> bool:
        run = self._runs.get(run_id)
        if run is None or run.finished:
            return False
        self._end(run, end.status, end.error_code, end.error_message, end.events)
        run.revision = end.revision
        return True

    async def read_run(
        self, run_id: UUID, owner: str, conversation_id: UUID | None = None
    ) -> RunView | None:
        run = self._readable(run_id, owner)
        if run is None or conversation_id not in (None, run.new.conversation_id):
            return None
        found = self._conversations.get(run.new.conversation_id)
        at = found.at(run.revision) if found and run.revision else None
        committed = found.turns[at] if found and at is not None else None
        return run.view(committed.assistant_message if committed else None)

    async def run_events(
        self, run_id: UUID, owner: str, after: int
    ) -> tuple[RunView, list[RunEvent]] | None:
        run = self._readable(run_id, owner)
        if run is None:
            return None
        return run.view(), [e for e in run.events if e.seq > after]

    async def forget_run(self, run_id: UUID, owner: str) -> None:
        run = self._runs.get(run_id)
        if run is not None and run.new.owner == owner and run.finished:
            del self._runs[run_id]

    async def watch_run(self, run_id: UUID) -> None:
        run = self._runs.get(run_id)
        if run is not None:
            run.watched = True  # in one process every event wakes its readers anyway

    async def cancel_run(self, run_id: UUID, owner: str) -> bool:
        run = self._readable(run_id, owner)
        if run is None or run.finished:
            return False
        run.cancel_requested = True
        self.notifications.notify(f"cancel:{run_id}")
        return True

    async def renew_runs(self, run_ids: Sequence[UUID], heartbeat_s: float) -> Renewed:
        for run_id in run_ids:
            run = self._runs.get(run_id)
            if run is not None and not run.finished:
                run.heartbeat_until = _now() + timedelta(seconds=heartbeat_s)
        watched = {i for i in run_ids if (run := self._runs.get(i)) and run.watched}
        return Renewed(frozenset(await self.cancel_requested(run_ids)), frozenset(watched))

    async def cancel_requested(self, run_ids: Sequence[UUID]) -> set[UUID]:
        return {i for i in run_ids if (run := self._runs.get(i)) and run.cancel_requested}

    async def interrupt_run(self, run_id: UUID, owner: str, message: str, event_data: str) -> bool:
        run = self._runs.get(run_id)
        if run is None or run.finished or run.heartbeat_until >= _now():
            return False
        seq = (run.events[-1].seq if run.events else 0) + 1
        self._end(
            run, "failed", "turn_interrupted", message, [RunEvent(seq, events.ERROR, event_data)]
        )
        return True

    def _readable(self, run_id: UUID, owner: str) -> _Run | None:
        run = self._runs.get(run_id)
        if run is None or run.new.owner != owner:
            return None
        if run.expires_at is not None and run.expires_at <= _now():
            return None
        return run

    def _end(
        self,
        run: _Run,
        status: RunStatus,
        code: str | None,
        message: str | None,
        events: Sequence[RunEvent],
    ) -> None:
        known = {e.seq for e in run.events}
        run.events += [e for e in events if e.seq not in known]
        run.status, run.error_code, run.error_message = status, code, message
        run.expires_at = _now() + self._events_ttl
        self.notifications.notify(f"events:{run.new.id}")

    async def delete(self, removal: Removal, if_match: Precondition = None) -> None:
        conversation_id, owner = removal.conversation_id, removal.owner
        self._holds(removal.idempotency)
        found = self._live(conversation_id, owner)
        if found is None:
            raise ConversationNotFound()
        check_precondition(if_match, found.row.revision)
        self._forget(conversation_id)
        self._completed(removal.idempotency, None, None)

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None, finding: Finding | None = None
    ) -> tuple[list[Summary], str | None]:
        rows = sorted(
            (
                c.row
                for c in self._conversations.values()
                if self._live(c.row.id, owner)
                and (
                    finding is None
                    or finding.matches(c.row.created_at, c.row.updated_at, c.terms())
                )
            ),
            key=lambda row: (row.created_at, row.id),
            reverse=True,
        )
        position = decode_cursor(after)
        rows = [row for row in rows if (row.created_at, row.id) < position]
        page = [Summary(r.id, r.revision, r.created_at, r.updated_at) for r in rows[:limit]]
        cursor = encode_cursor(page[-1]) if len(page) == limit else None
        return page, cursor

    async def usage(
        self, owner: str, since: datetime, until: datetime, group_by: str
    ) -> list[UsageTotal]:
        sums: dict[str, tuple[int, Usage]] = {}
        for found in list(self._conversations.values()):
            if self._live(found.row.id, owner) is None:
                continue
            for turn in found.turns:
                at = turn.created_at
                if at is None or not since <= at < until:
                    continue
                key = {
                    "day": at.astimezone(UTC).strftime("%Y-%m-%d"),
                    "model": turn.origin.model if turn.origin else "",
                    "conversation": str(found.row.id),
                }[group_by]
                turns, usage = sums.get(key, (0, Usage()))
                sums[key] = (turns + 1, usage + (turn.usage or Usage()))
        return [
            UsageTotal(
                key, turns, replace(usage, total_tokens=usage.input_tokens + usage.output_tokens)
            )
            for key, (turns, usage) in sorted(sums.items())
        ]

    async def claim(self, key: IdempotencyKey, turn_id: UUID | None = None) -> Committed | None:
        found = self._keys.get((key.owner, key.key))
        if found is None or found.expires_at < _now():
            claim = _Key(key.request_hash, _now() + self._lease, turn_id=turn_id, claim=key.claim)
            self._keys[key.owner, key.key] = claim
            return None
        return _answer(found, key)

    async def check(self, key: IdempotencyKey) -> None:
        found = self._keys.get((key.owner, key.key))
        if found is not None and found.expires_at >= _now():
            _answer(found, key)

    async def release(self, key: IdempotencyKey, *, in_doubt: bool = True) -> None:
        found = self._keys.get((key.owner, key.key))
        if found is not None and found.committed is None and found.claim == key.claim:
            del self._keys[key.owner, key.key]

    async def release_run(self, turn_id: UUID, owner: str) -> None:
        for name, found in list(self._keys.items()):
            if name[0] == owner and found.turn_id == turn_id and found.committed is None:
                del self._keys[name]

    async def renew(self, keys: Sequence[IdempotencyKey], lease_s: float) -> None:
        until = _now() + timedelta(seconds=lease_s)
        for key in keys:
            found = self._keys.get((key.owner, key.key))
            if found is not None and found.committed is None and found.claim == key.claim:
                found.expires_at = until

    def _holds(self, key: IdempotencyKey | None) -> None:
        """Before a write: RequestInProgress (nothing written) unless its attempt still holds
        its key's claim, as the store's statements check it."""
        if key is None:
            return
        found = self._keys.get((key.owner, key.key))
        if found is None or found.committed is not None or found.claim != key.claim:
            raise RequestInProgress()

    def _completed(
        self, key: IdempotencyKey | None, cid: UUID | None, revision: int | None
    ) -> None:
        """A write's key names what it did (as the store's transaction completes it)."""
        if key is None:
            return
        found = self._keys[key.owner, key.key]
        found.committed = Committed(cid, revision, found.turn_id)
        found.expires_at = _now() + self._ttl

    async def purge(self, batch: int = 500) -> int:
        now = _now()
        for name, key in list(self._keys.items()):
            if key.expires_at < now:
                del self._keys[name]
        for run_id, run in list(self._runs.items()):
            if run.expires_at is not None and run.expires_at < now:
                del self._runs[run_id]
        expired = [cid for cid, c in self._conversations.items() if self._gone(c, now)]
        for cid in expired:
            self._forget(cid)
        return len(expired)

    async def readiness(self) -> Readiness:
        return Readiness(head_revision(), writable=True)

    def pool_in_use(self) -> int:
        return 0

    async def close(self) -> None:
        return None

    def _forget(self, conversation_id: UUID) -> None:
        del self._conversations[conversation_id]
        for run_id, run in list(self._runs.items()):
            if run.new.conversation_id == conversation_id:
                del self._runs[run_id]
        for name, key in list(self._keys.items()):
            if key.committed is not None and key.committed.conversation_id == conversation_id:
                del self._keys[name]


def _answer(found: _Key, key: IdempotencyKey) -> Committed:
    if found.request_hash != key.request_hash:
        raise IdempotencyKeyReused()
    if found.committed is None:
        raise RequestInProgress(turn_id=found.turn_id)
    return found.committed


def _now() -> datetime:
    return datetime.now(UTC)
