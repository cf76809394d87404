"""The turn lease: two turns of one conversation meet the same way on every replica.

Before the provider is called, a turn takes its conversation's lease in PostgreSQL, in the same
statement that loads (or revalidates) the conversation. With ``queue`` a turn that finds the
lease taken waits for it, up to ``queue_wait_s``, woken by the holder's release (NOTIFY, see
``Notifications``) or, at the latest, when the holder's lease runs out; with ``reject``, or
when the wait runs out, it fails at once with ConversationBusy: the provider is not called and
nothing is kept. A held lease is renewed every third of ``lease_s`` and expires ``lease_s``
after its holder stops renewing it, so a replica that dies blocks its conversation that long
at most. The commit releases the lease in its own statement; a turn that does not commit gives
it back. The conditional commit on the revision stays the final guard.

Within a process, turns of one conversation first queue on an in-process lock (no database
traffic for them), with the same outcomes: ``reject`` refuses at once, ``queue`` waits up to
the same deadline.

A running turn also holds a place among its owner's running turns (OWNER_MAX_RUNNING_TURNS,
store/postgres/running_turns.py): taken with the lease (a new conversation's turn, which has no
lease, by ``take``), renewed with the leases, given back by the commit or on the way out. A
turn that waits holds none; past the limit a turn is TooManyRequests before the provider is
called. Provider calls outside a turn (a stateless call) hold one too (``place``). A turn that
makes a fork takes the fork's place among its owner's forks of the minute before its provider
call (``take_fork``), given back unless it commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from service.core.errors import (
    ConversationBusy,
    ConversationNotFound,
    StorageError,
    TooManyRequests,
)
from service.core.model import Append, Commit, Conversation, LeaseAttempt, LeaseRequest, Origin
from service.core.plans import TurnPlan
from service.platform import metrics, tracing
from service.store.ports import History, Notifications, Places
from service.usecases.heartbeat import Heartbeat
from service.usecases.locks import KeyedLocks, settle
from service.usecases.owner_limits import OwnerLimit

log = logging.getLogger("turnstore.leases")

FIRST_POLL_S = 0.05  # without notifications, look again this soon, then twice as late ...
LAST_POLL_S = 1.0  # ... up to this
SAFETY_POLL_S = 5.0  # with notifications, look again at least this often anyway
WAITED_S = 0.001  # a turn that got its lease later than this after it asked has queued
RELEASE_RETRY_S = 0.5  # how often a lease that could not be given back is tried again
MAX_REFUSED = 10_000  # leases the database refused to release, kept for a takeover here


@dataclass(frozen=True)
class LeasePolicy:
    queue: bool = True  # TURN_CONCURRENCY=queue (False: reject)
    queue_wait_s: float = 30.0  # TURN_QUEUE_WAIT_S
    lease_s: float = 30.0  # TURN_LEASE_S
    max_queued: int | None = None  # OWNER_MAX_QUEUED_TURNS: one owner's waiting turns here
    window_bytes: int | None = None  # CONTEXT_MAX_REQUEST_BYTES: how far back a turn reads


@dataclass
class Held:
    """What a turn holds: the conversation as it is now (None: a new one, with no row to
    lease yet) and the lease's holder id. ``committed``: the commit released the lease.
    ``begun``: the holder is a run, begun at the conversation's revision by the lease's
    statement (LeaseRequest.run)."""

    conversation: Conversation | None
    holder: uuid.UUID
    committed: bool = False
    begun: bool = False


class Leases:
    def __init__(
        self,
        history: History,
        places: Places,
        notifications: Notifications,
        policy: LeasePolicy | None = None,
    ) -> None:
        self._history = history
        self._places = places
        self._notifications = notifications
        self.policy = policy or LeasePolicy()
        self._locks = KeyedLocks()  # this process's turns of a conversation, one at a time
        self._keeper = _Keeper(places, self.policy.lease_s)
        most = self.policy.max_queued
        self._queued = OwnerLimit(most, "turns waiting for their conversations") if most else None

    async def take(self, owner: str, holder: uuid.UUID) -> None:
        """A place for ``holder`` among ``owner``'s running turns, kept (renewed) until
        ``free``; TooManyRequests when the owner runs OWNER_MAX_RUNNING_TURNS turns on the
        whole fleet. (A turn of an existing conversation takes its place with its lease.)"""
        if not await self._places.take_turn(owner, holder, self.policy.lease_s):
            raise TooManyRequests.running_turns()
        self._keeper.count(owner, holder)

    async def place(self, owner: str) -> Callable[[], Awaitable[None]]:
        """A place of its own for a provider call outside a turn (a stateless call, a relayed
        compaction: the provider works on the operator's key all the same), taken now, or
        TooManyRequests; what gives it back."""
        holder = uuid.uuid4()
        await self.take(owner, holder)
        return functools.partial(self.free, owner, holder)

    @asynccontextmanager
    async def placed(self, owner: str) -> AsyncIterator[None]:
        """``place`` for the time inside."""
        give_back = await self.place(owner)
        try:
            yield
        finally:
            await give_back()

    def keep(self, owner: str, holder: uuid.UUID) -> None:
        """A place its caller took otherwise (a run, as it was made): renewed until ``free``."""
        self._keeper.count(owner, holder)

    async def free(self, owner: str, holder: uuid.UUID, *, committed: bool = False) -> None:
        """The place given back, unless the turn's commit did (``committed``). Never raises
        but a cancellation: a place not given back stops counting after a lease anyway."""
        self._keeper.uncount(holder)
        if committed:
            return
        try:
            await settle(self._places.free_turn(owner, holder))
        except StorageError:
            pass  # the database failed: it expires
        except Exception:
            log.exception("could not give a running turn's place back; it expires")

    async def take_fork(self, owner: str, conversation_id: uuid.UUID) -> None:
        """The place of the fork a turn makes among its owner's forks of the minute
        (OWNER_MAX_FORKS_PER_MINUTE), taken before its provider call; TooManyRequests past
        it. Its commit makes the fork; a turn that does not commit gives it back."""
        await self._places.take_fork(owner, conversation_id)

    async def free_fork(self, owner: str, conversation_id: uuid.UUID) -> None:
        await self._places.free_fork(owner, conversation_id)

    async def commit(self, append: Append) -> Commit:
        """The turn's commit (History.append), which gives its lease and its place back in
        its own statement (the caller then marks its ``Held.committed``). From now on the lease
        may be gone at any moment: a renewal that misses it does not report it lost."""
        if append.lease is not None:
            self._keeper.releasing(append.lease)
        return await self._history.append(append)

    @asynccontextmanager
    async def hold(
        self, plan: TurnPlan, run_id: uuid.UUID | None = None, origin: Origin | None = None
    ) -> AsyncIterator[Held]:
        """The conversation with its lease held for the turn of ``plan``, and the turn's place
        among its owner's running turns, renewed while inside and given back on the way out
        unless the commit did. ``run_id``: a run's turn, whose place the run took when it was
        made and gives back itself (``keep``, ``free``); it holds the lease as the run.
        ``origin``: what the turn's request is for (its window is read for it).
        Raises ConversationBusy, TooManyRequests, ConversationNotFound, StorageError."""
        holder, cid, started = run_id or uuid.uuid4(), plan.conversation_id, time.monotonic()
        deadline = started + (self.policy.queue_wait_s if self.policy.queue else 0)
        local = self._locks.hold(cid, wait_s=max(0.0, deadline - started))
        placed = run_id is not None  # a run's place, taken when it was made
        try:
            if self._locks.taken(cid):  # another turn of this process has it: wait, counted
                with self._waiting(plan.owner):
                    if placed:  # a turn that waits is not running: its place is given back
                        await self.free(plan.owner, holder)
                        placed = False
                    with metrics.TURNS_WAITING.track_inprogress():
                        await local.__aenter__()
            else:
                await local.__aenter__()
        except TimeoutError:
            raise _busy() from None
        held = Held(None, holder)
        try:
            if plan.is_new:  # its id is new: no other turn can hold it (and it waited for none)
                if not placed:
                    await self.take(plan.owner, holder)
                yield held
                return
            async with self._leased(plan, held, started, deadline, origin, run=run_id is not None):
                yield held
        finally:
            # The in-process lock goes whatever giving the place back raised (or a
            # cancellation meanwhile): held on, it would make every later turn of the
            # conversation here wait for it in vain (409 conversation_busy).
            try:
                if run_id is None:
                    await self.free(plan.owner, holder, committed=held.committed)
            finally:
                await local.__aexit__(None, None, None)

    @asynccontextmanager
    async def _leased(
        self,
        plan: TurnPlan,
        held: Held,
        started: float,
        deadline: float,
        origin: Origin | None,
        *,
        run: bool,
    ) -> AsyncIterator[None]:
        """The conversation's lease taken for ``held`` (the conversation as loaded then),
        renewed while inside and given back on the way out unless the commit did. ``run``:
        the holder is a run's, which the lease's statement begins (``held.begun``)."""
        cid, holder = plan.conversation_id, held.holder
        with tracing.span("turn.lease") as span:
            held.conversation = await self._acquire(plan, holder, deadline, origin, run)
            held.begun = run
            span.set_attribute("turnstore.waited_s", time.monotonic() - started)
            span.set_attribute("turnstore.revision", held.conversation.revision)
        waited = time.monotonic() - started
        if waited > WAITED_S:
            metrics.TURNS_QUEUED.inc()
            metrics.QUEUE_WAIT_SECONDS.observe(waited)
        self._keeper.taken(cid)
        self._keeper.add(cid, holder)
        try:
            yield
        finally:
            self._keeper.discard(holder)
            if not held.committed:
                await self._release(cid, holder)

    async def _release(self, cid: uuid.UUID, holder: uuid.UUID) -> None:
        """The lease given back now, or (whatever failed) later by the keeper, or taken over by
        the next turn here; never kept until it expires because giving it back failed."""
        try:
            await settle(self._places.release_lease(cid, holder))
        except StorageError as exc:
            self._keeper.abandon(cid, holder, exc)
        except Exception:
            log.exception("could not give a turn lease back; trying again")
            self._keeper.abandon(cid, holder)

    async def close(self) -> None:
        await self._keeper.close()

    async def _acquire(
        self, plan: TurnPlan, holder: uuid.UUID, deadline: float, origin: Origin | None, run: bool
    ) -> Conversation:
        """Take the lease, waiting for it per the policy; the conversation as loaded then.
        Most turns find it free: only a refused turn subscribes to its release, and then asks
        again at once (a release between the refusal and the subscription is not missed)."""
        attempt = await self._attempt(plan, holder, origin, run)
        if attempt.acquired:
            return self._running(plan, holder, attempt)
        if deadline <= time.monotonic():
            raise _busy()
        # A turn that waits is not running: its place (a run's, taken when it was made) is
        # given back meanwhile, and taken again with the lease.
        await self.free(plan.owner, holder)
        topic, poll = f"lease:{plan.conversation_id}", FIRST_POLL_S
        with self._waiting(plan.owner), metrics.TURNS_WAITING.track_inprogress():
            async with self._notifications.subscribe(topic) as released:
                while True:
                    released.clear()
                    attempt = await self._attempt(plan, holder, origin, run)
                    if attempt.acquired:
                        return self._running(plan, holder, attempt)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _busy()
                    # Look again when woken, when the holder's lease runs out, or after a while.
                    if self._notifications.healthy:
                        wait = SAFETY_POLL_S
                    else:
                        wait, poll = poll, min(poll * 2, LAST_POLL_S)
                    if attempt.busy_until is not None:
                        expiry = attempt.busy_until.timestamp() - time.time() + 0.01
                        wait = min(wait, max(expiry, 0.01))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(wait, left)):
                            await released.wait()

    @contextlib.contextmanager
    def _waiting(self, owner: str) -> Iterator[None]:
        """A turn of ``owner`` waits for its conversation (OWNER_MAX_QUEUED_TURNS on this
        replica: past it, TooManyRequests before it waits)."""
        if self._queued is None:
            yield
            return
        leave = self._queued.take(owner)
        try:
            yield
        finally:
            leave()

    def _running(self, plan: TurnPlan, holder: uuid.UUID, attempt: LeaseAttempt) -> Conversation:
        """The lease is taken, and with it the turn's place: renewed from now on."""
        self._keeper.count(plan.owner, holder)
        return _found(attempt)

    async def _attempt(
        self, plan: TurnPlan, holder: uuid.UUID, origin: Origin | None, run: bool
    ) -> LeaseAttempt:
        """One try; ConversationNotFound when there is no such conversation (of this owner)."""
        try:
            attempt = await self._history.lease(
                LeaseRequest(
                    plan.conversation_id,
                    plan.owner,
                    holder,
                    lease_s=self.policy.lease_s,
                    queue=self.policy.queue,
                    replaces=self._keeper.abandoned_in(plan.conversation_id),
                    window_bytes=self.policy.window_bytes,
                    window_origin=origin,
                    run=run,
                )
            )
        except Exception:
            # It may have taken the lease before its answer was lost: give it back.
            self._keeper.abandon(plan.conversation_id, holder)
            raise
        if attempt.crowded:
            raise TooManyRequests.running_turns()
        if attempt.conversation is None:
            raise ConversationNotFound()
        return attempt


def _found(attempt: LeaseAttempt) -> Conversation:
    assert attempt.conversation is not None  # _attempt raised ConversationNotFound otherwise
    return attempt.conversation


def _busy() -> ConversationBusy:
    metrics.TURNS_BUSY.inc()
    return ConversationBusy()


class _Keeper:
    """Renews every lease this process holds, in one statement every third of a lease, and
    gives back the leases its turns could not give back themselves (the database failed):
    turns queued for them elsewhere need not wait for them to expire."""

    def __init__(self, places: Places, lease_s: float) -> None:
        self._places = places
        self._lease_s = lease_s
        self._held: dict[uuid.UUID, uuid.UUID] = {}  # holder -> conversation
        self._counted: dict[uuid.UUID, str] = {}  # holder -> owner (OWNER_MAX_RUNNING_TURNS)
        self._releasing: set[uuid.UUID] = set()  # held leases whose commit gives them back
        self.abandoned: set[tuple[uuid.UUID, uuid.UUID]] = set()  # (conversation, holder)
        self._refusals: set[str | None] = set()  # SQLSTATEs of hopeless releases, logged
        self.refused: set[tuple[uuid.UUID, uuid.UUID]] = set()  # releases never retried
        self._heartbeat = Heartbeat(
            lease_s / 3,
            self._renew,
            lambda: bool(self._held or self._counted or self.abandoned),
            between=self._give_back,
            poll_s=lambda: RELEASE_RETRY_S if self.abandoned else None,
        )

    def add(self, conversation_id: uuid.UUID, holder: uuid.UUID) -> None:
        self._held[holder] = conversation_id
        self._heartbeat.start()

    def discard(self, holder: uuid.UUID) -> None:
        self._held.pop(holder, None)
        self._releasing.discard(holder)

    def releasing(self, holder: uuid.UUID) -> None:
        """The lease's commit is on its way: still renewed (a commit can be slow), but not
        missed when a renewal finds it given back."""
        if holder in self._held:
            self._releasing.add(holder)

    def count(self, owner: str, holder: uuid.UUID) -> None:
        """A place among the owner's running turns, renewed with the leases."""
        self._counted[holder] = owner
        self._heartbeat.start()

    def uncount(self, holder: uuid.UUID) -> None:
        self._counted.pop(holder, None)

    def abandon(
        self, conversation_id: uuid.UUID, holder: uuid.UUID, error: StorageError | None = None
    ) -> None:
        """Give the lease back later: unless the database refused that as it always will
        (then retrying it every RELEASE_RETRY_S would only add load; the lease expires)."""
        if error is not None and error.hopeless:
            self._refused(error, conversation_id, holder)
            return
        self.abandoned.add((conversation_id, holder))
        self._heartbeat.wake()

    def _refused(self, error: StorageError, conversation_id: uuid.UUID, holder: uuid.UUID) -> None:
        """Kept for this process's next turn of the conversation to take over (``replaces``),
        never tried again; logged once per SQLSTATE: the same refusal says nothing new."""
        if len(self.refused) >= MAX_REFUSED:  # their leases have long expired
            self.refused.clear()
        self.refused.add((conversation_id, holder))
        if error.sqlstate not in self._refusals:
            self._refusals.add(error.sqlstate)
            log.error(
                "the database refuses to give turn leases back (SQLSTATE %s), which no retry"
                " changes: they expire, or a turn of this replica takes them over",
                error.sqlstate,
            )

    def abandoned_in(self, conversation_id: uuid.UUID) -> uuid.UUID | None:
        """A holder of this process that could not give back its lease of the conversation."""
        return next((h for c, h in self.abandoned | self.refused if c == conversation_id), None)

    def taken(self, conversation_id: uuid.UUID) -> None:
        """A turn here holds the conversation's lease now: a refused holder of it is gone."""
        self.refused = {(c, h) for c, h in self.refused if c != conversation_id}

    async def close(self) -> None:
        await self._heartbeat.close()

    async def _give_back(self) -> None:
        for cid, holder in list(self.abandoned):
            try:
                await self._places.release_lease(cid, holder)
            except StorageError as exc:
                if not exc.hopeless:
                    continue
                self._refused(exc, cid, holder)
            self.abandoned.discard((cid, holder))

    async def _renew(self) -> None:
        places = [(owner, holder) for holder, owner in self._counted.items()]
        if places:
            try:
                await self._places.renew_turns(places, self._lease_s)
            except StorageError:
                log.warning("could not renew %d running turns' places", len(places))
        leases = [(cid, holder) for holder, cid in self._held.items()]
        if not leases:
            return
        try:
            renewed = await self._places.renew_leases(leases, self._lease_s)
        except StorageError:
            log.warning("could not renew %d turn leases; they expire if this lasts", len(leases))
            return
        # Lost: a lease renewed for a turn that still holds it here, not given back by its
        # commit, and not found. Not a lease taken while the renewal was on its way (it was
        # not in it), nor one released or committed meanwhile, nor one whose conversation's
        # next turn here took it after its own (another holder).
        lost = sum(
            1
            for cid, holder in leases
            if cid not in renewed
            and self._held.get(holder) == cid
            and holder not in self._releasing
        )
        if lost:
            log.warning("%d turn leases were lost (expired and taken over)", lost)
