"""Durable turns: a turn that survives its client.

Every streamed turn, and every turn sent with ``"background": true``, runs as a *run*: a task
of this process that numbers the events its client sees (``message.delta``, ``tool.call``,
then one ``message.done`` or ``error``), hands each to this process's subscribers at once and
to the event log in PostgreSQL in batches, so that a reader on any replica can replay them and
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
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from service.core.errors import (
    Cancelled,
    NotReady,
    RequestInProgress,
    StorageError,
    TurnInterrupted,
    TurnNotFound,
    TurnstoreError,
    envelope,
)
from service.core.model import NewRun, Renewed, RunCommit, RunEnd, RunEvent, RunStatus, RunView
from service.core.plans import TurnPlan
from service.platform.logs import correlation_id_var
from service.platform.shutdown import SHUTDOWN
from service.providers.base import TextDelta
from service.store.ports import IdempotencyStore, Notifications, RunStore
from service.usecases.exchange import ToolCalled
from service.usecases.locks import settle
from service.usecases.turns import TurnDone, TurnEvent, TurnService, TurnStarted

log = logging.getLogger("turnstore.runs")

FLUSH_S = 0.05  # a watched run's events reach the log, and readers elsewhere, this soon
IDLE_FLUSH_S = 1.0  # an unwatched run's: what a replica that dies takes with it
CANCEL_POLL_S = 1.0  # without notifications: how often a replica asks about cancellations
FOLLOW_POLL_S = (0.1, 1.0)  # a reader elsewhere looks again after this long (no / working
# notifications)
INTERRUPTED = "The replica running this turn stopped before the commit; nothing was kept."
GONE = "The client went away before the turn committed; nothing was kept."
_JSON = msgspec.json.Encoder()


@dataclasses.dataclass(frozen=True)
class Started:
    """A run started, or the one an Idempotency-Key retry of a background turn names."""

    turn_id: uuid.UUID
    conversation_id: uuid.UUID
    status: RunStatus
    run: Run | None  # None: it runs (or ran) elsewhere: follow it through the log


class Run:
    """A durable turn running in this process."""

    def __init__(self, new: NewRun, plan: TurnPlan, correlation_id: str, store: RunStore) -> None:
        self.new, self.id, self.plan = new, new.id, plan
        self.correlation_id = correlation_id
        self.events: list[RunEvent] = []
        self.finished = False
        self.stop_reason: TurnstoreError = Cancelled()
        self.task: asyncio.Task[None] | None = None
        self._store = store
        self._logged = 0  # events[:_logged] are in the log
        self._flush_lock = asyncio.Lock()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()
        self._commit: RunCommit | None = None
        self._watched = False

    async def begin(self) -> None:
        await self._store.begin_run(self.id)

    def publish(self, name: str, data: dict[str, Any]) -> None:
        self._add(RunEvent(len(self.events) + 1, name, _JSON.encode(data).decode()))
        if self._flush_timer is None:
            delay = FLUSH_S if self._watched else IDLE_FLUSH_S
            self._flush_timer = asyncio.get_running_loop().call_later(delay, self._flush_soon)

    def watched(self) -> None:
        """Someone follows the run from elsewhere: log what it has now, and soon from now on."""
        if not self._watched and not self.finished:
            self._watched = True
            self._cancel_timer()
            self._flush_soon()

    async def follow(self, after: int = 0) -> AsyncGenerator[RunEvent, None]:
        """Its events after ``after``, as they come, to its terminal event."""
        index = after
        while True:
            while index < len(self.events):
                index += 1
                yield self.events[index - 1]
            if self.finished:
                return
            self._changed.clear()
            await self._changed.wait()

    def stop(self, reason: TurnstoreError) -> None:
        if self.task is not None and not self.finished:
            self.stop_reason = reason
            self.task.cancel()

    async def flush(self) -> None:
        async with self._flush_lock:
            batch = self.events[self._logged :]
            if batch:
                await self._store.log_events(self.id, self.new.owner, batch)
                self._logged += len(batch)

    async def prepare_commit(self, status: RunStatus, incomplete_reason: str | None) -> RunCommit:
        """What the turn's commit writes of this run (its events so far are logged first)."""
        self._cancel_timer()
        await self.flush()
        fields = {
            "status": status,
            "incomplete_reason": incomplete_reason,
            "conversation_id": str(self.plan.conversation_id),
            "turn_id": str(self.id),
        }

        def done_data(revision: int) -> str:
            return _JSON.encode({**fields, "revision": revision}).decode()

        self._commit = RunCommit(self.id, status, len(self.events) + 1, done_data)
        return self._commit

    async def done_event(self, done: TurnDone) -> None:
        """The turn ended with message.done: its commit logged it (publish it here too, as
        logged); or nothing was committed (the content filter), or an Idempotency-Key replay
        names an earlier commit: the run ends with it now."""
        commit = self._commit
        if commit is not None and done.revision is not None:
            event = RunEvent(commit.done_seq, "message.done", commit.done_data(done.revision))
            self._add(event)
            self._logged = len(self.events)
            return
        data = {
            "status": done.status,
            "incomplete_reason": done.incomplete_reason,
            "conversation_id": str(done.conversation_id),
            "revision": done.revision,
            "turn_id": str(self.id),
        }
        if done.revision is None:
            await self.end("failed", "content_filtered", "The content filter refused it.", data)
        else:
            await self.end(done.status, None, None, data, done.revision)

    async def end(
        self,
        status: RunStatus,
        code: str | None,
        message: str | None,
        data: Any,
        revision: int | None = None,
    ) -> None:
        """End without a commit of its own: the terminal event after the others, logged with
        the end. Should the run have ended meanwhile (committed, interrupted elsewhere), what
        the log says is published here instead."""
        self._cancel_timer()
        terminal = RunEvent(len(self.events) + 1, *_terminal(data))
        async with self._flush_lock:
            events = [*self.events[self._logged :], terminal]
            end = RunEnd(status, code, message, events, revision)
            try:
                ended = await self._store.end_run(self.id, self.new.owner, end)
            except StorageError:
                # Its client here still gets its terminal event; readers elsewhere will find
                # the run stalled once its heartbeat runs out, and end it as interrupted.
                self._add(terminal)
                raise
            if ended:
                self._add(terminal)
                self._logged = len(self.events)
                return
        await self.catch_up()

    async def catch_up(self) -> None:
        """Publish what the log holds beyond what this process published."""
        found = await self._store.run_events(self.id, self.new.owner, len(self.events))
        for event in found[1] if found else ():
            self._add(event)
        self._logged = len(self.events)

    def done(self) -> None:
        self.finished = True
        self._cancel_timer()
        self._changed.set()

    def _add(self, event: RunEvent) -> None:
        self.events.append(event)
        self._changed.set()

    def _flush_soon(self) -> None:
        self._flush_timer = None
        asyncio.get_running_loop().create_task(self._flush_logged())

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except StorageError:
            log.warning(
                "turn %s: could not log its events (they are kept for the next try)", self.id
            )

    def _cancel_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None


def _missed_end(view: RunView, after: int) -> bool:
    """Whether a client that saw events up to ``after`` of this finished run missed its end:
    it saw more than the log holds, or, when its replica died, it saw a delta numbered like
    the terminal event written for it later."""
    if view.error_code == "turn_interrupted":
        return after >= view.last_event
    return after > view.last_event


def _terminal(data: dict[str, Any]) -> tuple[str, str]:
    name = "message.done" if "status" in data else "error"
    return name, _JSON.encode(data).decode()


class TurnRuns:
    """The runs of this process, and what readers anywhere ask of runs."""

    def __init__(
        self,
        turns: TurnService,
        store: RunStore,
        notifications: Notifications,
        *,
        heartbeat_s: float,
        idempotency: IdempotencyStore | None = None,
    ) -> None:
        self._turns = turns
        self._store = store
        self._notifications = notifications
        self._heartbeat_s = heartbeat_s
        self._idempotency = idempotency
        self._live: dict[uuid.UUID, Run] = {}
        self._keeper: asyncio.Task[None] | None = None
        self._shutdown_watch: asyncio.Task[None] | None = None

    # --- starting and running ----------------------------------------------------------------

    async def start(self, plan: TurnPlan, *, background: bool, correlation_id: str) -> Started:
        """Start the turn of ``plan`` as a run (a background turn's Idempotency-Key retry gets
        the run of the first attempt instead)."""
        new = NewRun(uuid.uuid4(), plan.conversation_id, plan.owner, background)
        if background and plan.idempotency is not None and self._idempotency is not None:
            try:
                committed = await self._idempotency.claim(plan.idempotency, new.id)
            except RequestInProgress as running:
                if running.turn_id is None:
                    raise
                return Started(running.turn_id, plan.conversation_id, "in_progress", None)
            if committed is not None and committed.turn_id is not None:
                return Started(committed.turn_id, committed.conversation_id, "completed", None)
            plan = dataclasses.replace(plan, claimed=True)
        await self._store.create_run(new, self._heartbeat_s)
        run = Run(new, plan, correlation_id, self._store)
        self._live[new.id] = run
        run.task = asyncio.get_running_loop().create_task(self._execute(run))
        self._start_watches()
        return Started(new.id, plan.conversation_id, "queued", run)

    async def _execute(self, run: Run) -> None:
        try:
            async with (
                self._notifications.subscribe(f"cancel:{run.id}") as cancelled,
                self._notifications.subscribe(f"watch:{run.id}") as watched,
                self._listening(run, cancelled, watched),
                aclosing(self._turns.events(run.plan, stream=True, run=run)) as events,
            ):
                async for event in events:
                    await self._publish(run, event)
        except asyncio.CancelledError:
            reason = run.stop_reason
            await settle(
                self._end(run, "cancelled" if reason.code == "cancelled" else "failed", reason)
            )
        except TurnstoreError as exc:
            await settle(self._end(run, "failed", exc))
        except Exception:
            log.exception("turn %s failed", run.id)
            await settle(self._end(run, "failed", TurnstoreError()))
        finally:
            run.done()
            self._live.pop(run.id, None)

    async def _publish(self, run: Run, event: TurnEvent) -> None:
        if isinstance(event, TurnStarted):
            return  # not asked for: a run numbers its own events
        if isinstance(event, TextDelta):
            run.publish("message.delta", {"delta": event.text})
        elif isinstance(event, ToolCalled):
            run.publish("tool.call", {"name": event.name, "status": event.status})
        else:
            await run.done_event(event)

    async def _end(self, run: Run, status: RunStatus, error: TurnstoreError) -> None:
        data = envelope(error.code, error.message, run.correlation_id)
        try:
            await run.end(status, error.code, error.message, data)
        except StorageError:
            log.warning("turn %s: could not log its end; readers will find it stalled", run.id)

    # --- what readers ask --------------------------------------------------------------------

    def live(self, turn_id: uuid.UUID, owner: str) -> Run | None:
        run = self._live.get(turn_id)
        return run if run is not None and run.new.owner == owner else None

    async def status(self, turn_id: uuid.UUID, owner: str) -> RunView:
        view = await self._store.read_run(turn_id, owner)
        if view is None:
            raise TurnNotFound()
        if view.stalled and await self._interrupt(view.id, owner):
            view = await self._store.read_run(turn_id, owner) or view
        return view

    async def events(
        self, turn_id: uuid.UUID, owner: str, after: int
    ) -> AsyncGenerator[RunEvent, None]:
        """The run's events after ``after``, then the live ones, to its terminal event."""
        run = self.live(turn_id, owner)
        if run is not None:
            async with aclosing(run.follow(after)) as events:
                async for event in events:
                    yield event
            return
        async with aclosing(self._follow_logged(turn_id, owner, after)) as events:
            async for event in events:
                yield event

    async def cancel(self, turn_id: uuid.UUID, owner: str) -> RunView:
        """Ask the run to stop, wherever it runs; its status once it stopped (or after a
        while: a turn whose commit began completes)."""
        if not await self._store.cancel_run(turn_id, owner):
            return await self.status(turn_id, owner)  # unknown (raises), or finished
        run = self.live(turn_id, owner)
        if run is not None:
            run.stop(Cancelled())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                async with aclosing(self.events(turn_id, owner, 1 << 30)) as events:
                    async for _ in events:
                        pass
        return await self.status(turn_id, owner)

    async def _follow_logged(
        self, turn_id: uuid.UUID, owner: str, after: int
    ) -> AsyncGenerator[RunEvent, None]:
        watching, sent = False, False
        async with self._notifications.subscribe(f"events:{turn_id}") as woken:
            while True:
                woken.clear()
                found = await self._store.run_events(turn_id, owner, after)
                if found is None:
                    raise TurnNotFound()
                view, events = found
                for event in events:
                    sent = True
                    after = event.seq
                    yield event
                if view.finished:
                    if not sent and view.last_event and _missed_end(view, after):
                        # The client saw more than the log holds (its replica died before
                        # logging it): its terminal event is still news to it.
                        terminal = await self._store.run_events(turn_id, owner, view.last_event - 1)
                        if terminal is not None:
                            for event in terminal[1]:
                                yield event
                    return
                if view.stalled:
                    await self._interrupt(turn_id, owner)
                    continue
                if not watching:
                    await self._store.watch_run(turn_id)
                    watching = True
                    continue  # events may have come before the watch: look once more
                healthy = self._notifications.healthy
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FOLLOW_POLL_S[healthy]):
                        await woken.wait()

    async def _interrupt(self, turn_id: uuid.UUID, owner: str) -> bool:
        """End a run whose replica vanished; its terminal event names the request that found
        it (the run's own request is gone with its replica)."""
        data = envelope("turn_interrupted", INTERRUPTED, correlation_id_var.get() or "")
        event = _JSON.encode(data).decode()
        return await self._store.interrupt_run(turn_id, owner, INTERRUPTED, event)

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
                with contextlib.suppress(StorageError):
                    # settle: a query cut short mid-connect would leave its connection open.
                    if await settle(self._store.cancel_requested([run.id])):
                        run.stop(Cancelled())
                        return

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

    def _start_watches(self) -> None:
        loop = asyncio.get_running_loop()
        if self._keeper is None or self._keeper.done():
            self._keeper = loop.create_task(self._keep())
        if self._shutdown_watch is None or self._shutdown_watch.done():
            self._shutdown_watch = loop.create_task(self._stop_on_shutdown())

    async def _keep(self) -> None:
        """Heartbeats every third of ``heartbeat_s``; cancellations asked for meanwhile (at
        once through notifications, else every CANCEL_POLL_S)."""
        renew_at = 0.0
        while self._live:
            ids = list(self._live)
            renewed = Renewed()
            try:
                if time.monotonic() >= renew_at:
                    renewed = await settle(self._store.renew_runs(ids, self._heartbeat_s))
                    renew_at = time.monotonic() + self._heartbeat_s / 3
                elif not self._notifications.healthy:
                    asked = await settle(self._store.cancel_requested(ids))
                    renewed = Renewed(frozenset(asked))
            except StorageError:
                log.warning("could not renew the heartbeats of %d turns", len(ids))
            for turn_id in renewed.watched:
                if (run := self._live.get(turn_id)) is not None:
                    run.watched()
            for turn_id in renewed.cancelled:
                if (run := self._live.get(turn_id)) is not None:
                    run.stop(Cancelled())
            await asyncio.sleep(min(CANCEL_POLL_S, max(renew_at - time.monotonic(), 0.01)))

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
        for task in (self._keeper, self._shutdown_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
