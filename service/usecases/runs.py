"""Durable turns: a turn that survives its client.

Every streamed turn, on either surface, and every turn sent with ``"background": true``, runs
as a *run* (service/usecases/run.py): a task of this process that numbers the events its
client sees (service/core/events.py), hands each to this process's subscribers at once and to
the event log in PostgreSQL in batches, so that a reader on any replica can replay them and
follow the live turn. A batch goes every ``IDLE_FLUSH_S`` while nobody follows the run from
elsewhere, every ``FLUSH_S`` once someone does (a reader elsewhere marks the run watched and
notifies its replica, which then logs what it has at once). The turn's commit ends the run and
logs its ``message.done`` in the same transaction; a run that does not commit is ended with
its terminal event by this process.

The replica running a run renews its heartbeat every third of ``heartbeat_s`` (TURN_LEASE_S).
A reader that finds an unfinished run whose heartbeat ran out ends it as ``failed`` with
``turn_interrupted``: its replica died, and its turn cannot have committed (a commit ends the
run in its own transaction, and fails if the run was ended first). Cancelling (from any
replica) marks the run and notifies its replica, which stops it; a replica without working
notifications asks for its runs' cancellations every ``CANCEL_POLL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

from service.core import events
from service.core.errors import (
    Cancelled,
    NotReady,
    RequestInProgress,
    StorageError,
    TooManyRequests,
    TurnInterrupted,
    TurnNotFound,
    TurnstoreError,
)
from service.core.events import RunEvent
from service.core.model import Committed, NewRun, Renewed, RunStatus, RunView
from service.core.plans import TurnPlan
from service.platform.logs import correlation_id_var
from service.platform.shutdown import SHUTDOWN
from service.store.ports import Notifications, RunReads, RunWrites
from service.usecases.heartbeat import Heartbeat
from service.usecases.locks import settle
from service.usecases.owner_limits import OwnerLimit
from service.usecases.run import Run
from service.usecases.turns import TurnService

log = logging.getLogger("turnstore.runs")

CANCEL_POLL_S = 1.0  # without notifications: how often a replica asks about cancellations
FOLLOW_POLL_S = (0.1, 1.0)  # a reader elsewhere looks again after this long (no / working
# notifications)


@dataclasses.dataclass(frozen=True)
class Started:
    """A run started, or the one an Idempotency-Key retry names."""

    turn_id: uuid.UUID
    conversation_id: uuid.UUID
    status: RunStatus
    run: Run | None  # None: it runs (or ran) elsewhere: follow it through the log


def _missed_end(view: RunView, after: int) -> bool:
    """Whether a client that saw events up to ``after`` of this finished run missed its end:
    it saw more than the log holds, or, when its replica died, it saw a delta numbered like
    the terminal event written for it later."""
    if view.error_code == "turn_interrupted":
        return after >= view.last_event
    return after > view.last_event


class _Earlier(Exception):
    """An Idempotency-Key retry found the earlier attempt's run."""

    def __init__(self, started: Started) -> None:
        self.started = started


class TurnRuns:
    """The runs of this process, and what readers anywhere ask of runs."""

    def __init__(
        self,
        turns: TurnService,
        writes: RunWrites,
        reads: RunReads,
        notifications: Notifications,
        *,
        heartbeat_s: float,
        readers: int = 32,
    ) -> None:
        self._readers = OwnerLimit(readers, "event readers")
        self._turns = turns
        self._writes, self._reads = writes, reads
        self._notifications = notifications
        self._heartbeat_s = heartbeat_s
        self._live: dict[uuid.UUID, Run] = {}
        self._heartbeat = Heartbeat(
            heartbeat_s / 3,
            self._renew,
            lambda: bool(self._live),
            between=self._poll_cancellations,
            poll_s=lambda: CANCEL_POLL_S,
            beat_first=True,
        )
        self._shutdown_watch: asyncio.Task[None] | None = None

    # --- starting and running ----------------------------------------------------------------

    async def start(
        self, plan: TurnPlan, *, correlation_id: str, existing: bool = False
    ) -> Started:
        """Start the turn of ``plan`` as a run; an Idempotency-Key retry of a turn that runs
        as a run gets that run instead (a retry of a plain turn still running: 409).
        ``existing``: the run is made only if its conversation exists, at the plan's If-Match
        (TurnService.check left that to it): ConversationNotFound, PreconditionFailed."""
        new = NewRun(
            uuid.uuid4(),
            plan.conversation_id,
            plan.owner,
            plan.background,
            plan.response,
            existing=existing,
            if_match=plan.if_match if existing else None,
        )
        try:
            committed = await self._claim(plan, new.id)
        except _Earlier as earlier:
            return earlier.started
        if committed is not None and committed.turn_id is not None and plan.background:
            return Started(committed.turn_id, committed.turn[0], "completed", None)
        replay = committed is not None  # of an earlier commit: no provider call, no place
        try:
            if not await self._writes.create_run(new, self._heartbeat_s, counted=not replay):
                raise TooManyRequests.running_turns()  # a JSON answer, before any stream
        except BaseException:  # before its turn: nothing of it can commit
            await self._turns.release(plan, in_doubt=False)
            raise
        if not replay:
            self._turns.leases.keep(plan.owner, new.id)
        run = Run(new, plan, correlation_id, self._writes, self._reads)
        self._live[new.id] = run
        run.task = asyncio.get_running_loop().create_task(self._execute(run, committed))
        self._heartbeat.start()
        self._watch_shutdown()
        # The run goes as far as its first statement (its lease) before the caller answers:
        # the lease's round trip and the answer's start (a stream's headers) overlap.
        await asyncio.sleep(0)
        return Started(new.id, plan.conversation_id, "queued", run)

    async def _execute(self, run: Run, committed: Committed | None) -> None:
        turn = self._turns.events(run.plan, stream=True, run=run, committed=committed)
        failure: tuple[RunStatus, TurnstoreError] | None = None
        try:
            run.begun = True
            if run.stopped_early:
                raise asyncio.CancelledError()
            async with (
                self._notifications.subscribe(f"cancel:{run.id}") as cancelled,
                self._notifications.subscribe(f"watch:{run.id}") as watched,
                self._listening(run, cancelled, watched),
                aclosing(turn) as turn_events,
            ):
                async for event in turn_events:
                    await run.record(event)
        except asyncio.CancelledError:
            reason = run.stop_reason
            failure = ("cancelled" if reason.code == "cancelled" else "failed", reason)
        except TurnstoreError as exc:
            failure = ("failed", exc)
        except Exception:
            log.exception("turn %s failed", run.id)
            failure = ("failed", TurnstoreError())
        finally:
            try:
                # Its place goes back before its terminal event: a client that reads the end
                # may start its next turn at once (its commit gave it back, or a replayed
                # earlier commit took none).
                ended = run.result is not None and run.result.revision is not None
                done = ended or bool(committed)
                await self._turns.leases.free(run.new.owner, run.id, committed=done)
            finally:
                if failure is not None:
                    await settle(run.fail(*failure))
                run.done()
                self._live.pop(run.id, None)

    # --- what readers ask --------------------------------------------------------------------

    def live(self, turn_id: uuid.UUID, owner: str) -> Run | None:
        run = self._live.get(turn_id)
        return run if run is not None and run.new.owner == owner else None

    async def view(
        self, turn_id: uuid.UUID, owner: str, conversation_id: uuid.UUID | None = None
    ) -> RunView | None:
        """The run as it is now (None: unknown, another owner's, of another conversation than
        ``conversation_id`` when that is known, expired)."""
        try:
            return await self.status(turn_id, owner, conversation_id)
        except TurnNotFound:
            return None

    async def find(
        self, conversation_id: uuid.UUID, owner: str, base_revision: int
    ) -> uuid.UUID | None:
        """The run whose turn held the conversation at ``base_revision``, if any."""
        return await self._reads.find_run(conversation_id, owner, base_revision)

    async def forget(self, turn_id: uuid.UUID, owner: str) -> None:
        """A finished run is forgotten now (its events too), not after TURN_EVENTS_TTL_S."""
        await self._writes.forget_run(turn_id, owner)

    async def status(
        self, turn_id: uuid.UUID, owner: str, conversation_id: uuid.UUID | None = None
    ) -> RunView:
        view = await self._reads.read_run(turn_id, owner, conversation_id)
        if view is None:
            raise TurnNotFound()
        if view.stalled and await self._interrupt(view.id, owner):
            view = await self._reads.read_run(turn_id, owner, conversation_id) or view
        return view

    def reader(self, owner: str) -> Callable[[], None]:
        """A slot for one more outside reader of ``owner``'s runs on this replica
        (OWNER_MAX_EVENT_READERS; TooManyRequests past it): call what it returns when the
        reader is gone."""
        return self._readers.take(owner)

    async def events(
        self, turn_id: uuid.UUID, owner: str, after: int
    ) -> AsyncGenerator[RunEvent, None]:
        """The run's events after ``after``, then the live ones, to its terminal event."""
        run = self.live(turn_id, owner)
        source = (
            run.follow(after) if run is not None else self._follow_logged(turn_id, owner, after)
        )
        async with aclosing(source) as found:
            async for event in found:
                yield event

    async def cancel(self, turn_id: uuid.UUID, owner: str) -> RunView:
        """Ask the run to stop, wherever it runs; its status once it stopped (or after a
        while: a turn whose commit began completes)."""
        if not await self._writes.cancel_run(turn_id, owner):
            return await self.status(turn_id, owner)  # unknown (raises), or finished
        run = self.live(turn_id, owner)
        if run is not None:
            run.stop(Cancelled())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                async with aclosing(self.events(turn_id, owner, 1 << 30)) as rest:
                    async for _ in rest:
                        pass
        return await self.status(turn_id, owner)

    async def _follow_logged(
        self, turn_id: uuid.UUID, owner: str, after: int
    ) -> AsyncGenerator[RunEvent, None]:
        watching, sent = False, False
        async with self._notifications.subscribe(f"events:{turn_id}") as woken:
            while True:
                woken.clear()
                found = await self._reads.run_events(turn_id, owner, after)
                if found is None:
                    raise TurnNotFound()
                view, logged = found
                for event in logged:
                    sent = True
                    after = event.seq
                    yield event
                if view.finished:
                    if not sent and view.last_event and _missed_end(view, after):
                        # The client saw more than the log holds (its replica died before
                        # logging it): its terminal event is still news to it.
                        terminal = await self._reads.run_events(turn_id, owner, view.last_event - 1)
                        if terminal is not None:
                            for event in terminal[1]:
                                yield event
                    return
                if view.stalled:
                    await self._interrupt(turn_id, owner)
                    continue
                if not watching:
                    await self._writes.watch_run(turn_id)
                    watching = True
                    continue  # events may have come before the watch: look once more
                healthy = self._notifications.healthy
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FOLLOW_POLL_S[healthy]):
                        await woken.wait()

    async def _claim(self, plan: TurnPlan, run_id: uuid.UUID) -> Committed | None:
        """The plan's Idempotency-Key claimed for ``run_id``. While an earlier attempt runs as
        a run, _Earlier names it as it is (its conversation, its status); one that ended
        without its commit frees the key, and the claim is made again."""
        for _ in range(2):
            try:
                return await self._turns.claim(plan, run_id)
            except RequestInProgress as running:
                if running.turn_id is None:
                    raise
                view = await self.view(running.turn_id, plan.owner)  # (interrupts a stalled one)
                if view is not None and not (view.finished and view.revision is None):
                    started = Started(view.id, view.conversation_id, view.status, None)
                    raise _Earlier(started) from None
                await self._turns.release_run(running.turn_id, plan.owner)
        raise RequestInProgress()

    async def _interrupt(self, turn_id: uuid.UUID, owner: str) -> bool:
        """End a run whose replica vanished (and free its Idempotency-Key); its terminal
        event names the request that found it (the run's own request is gone with its
        replica)."""
        error = events.failure(0, TurnInterrupted(), correlation_id_var.get() or "")
        ended = await self._writes.interrupt_run(turn_id, owner, events.INTERRUPTED, error.data)
        if ended:
            await self._turns.release_run(turn_id, owner)
        return ended

    # --- this process's part: heartbeats, cancellations, shutdown --------------------------------

    @contextlib.asynccontextmanager
    async def _listening(
        self, run: Run, cancelled: asyncio.Event, watched: asyncio.Event
    ) -> AsyncIterator[None]:
        """While inside: a notification about the run's cancellation makes it ask, and a
        cancellation asked for stops it (a notification is only a hint: after a listener
        reconnects, every subscriber is woken); one that a reader follows it from elsewhere
        makes it log its events at once and soon."""

        async def on_cancel() -> None:
            while True:
                await cancelled.wait()
                cancelled.clear()
                try:
                    # settle: a query cut short mid-connect would leave its connection open.
                    if await settle(self._reads.cancel_requested([run.id])):
                        run.stop(Cancelled())
                        return
                except StorageError:
                    pass  # asked again at the next notification, or by the heartbeat
                except Exception:
                    log.exception("turn %s: could not ask about its cancellation", run.id)

        async def on_watch() -> None:
            await watched.wait()
            run.watched()

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(on_cancel()), loop.create_task(on_watch())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _renew(self) -> None:
        """Heartbeats; the runs asked to stop or followed from elsewhere meanwhile."""
        ids = list(self._live)
        try:
            renewed = await settle(self._writes.renew_runs(ids, self._heartbeat_s))
        except StorageError:
            log.warning("could not renew the heartbeats of %d turns", len(ids))
            return
        self._act_on(renewed)

    async def _poll_cancellations(self) -> None:
        """Without notifications, cancellations are asked for (with them, they are heard)."""
        if self._notifications.healthy or not self._live:
            return
        with contextlib.suppress(StorageError):
            asked = await settle(self._reads.cancel_requested(list(self._live)))
            self._act_on(Renewed(frozenset(asked)))

    def _act_on(self, renewed: Renewed) -> None:
        for turn_id in renewed.watched:
            if (run := self._live.get(turn_id)) is not None:
                run.watched()
        for turn_id in renewed.cancelled:
            if (run := self._live.get(turn_id)) is not None:
                run.stop(Cancelled())

    def _watch_shutdown(self) -> None:
        if self._shutdown_watch is None or self._shutdown_watch.done():
            self._shutdown_watch = asyncio.get_running_loop().create_task(self._stop_on_shutdown())

    async def _stop_on_shutdown(self) -> None:
        """On SIGTERM, turns whose client waits for them end now (not_ready: retry on another
        replica); background turns may finish within the grace period (see ``close``)."""
        await SHUTDOWN.wait()
        for run in list(self._live.values()):
            if not run.new.background:
                run.stop(NotReady("This replica is shutting down; nothing of the turn was kept."))

    async def close(self, grace_s: float) -> None:
        """Let background runs finish for up to ``grace_s``, then end them interrupted."""
        running = [run.task for run in self._live.values() if run.task is not None]
        if running:
            await asyncio.wait(running, timeout=grace_s)
        for run in list(self._live.values()):
            run.stop(TurnInterrupted())
        remaining = [run.task for run in self._live.values() if run.task is not None]
        if remaining:
            await asyncio.wait(remaining, timeout=5)
        await self._heartbeat.close()
        if self._shutdown_watch is not None:
            self._shutdown_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shutdown_watch
