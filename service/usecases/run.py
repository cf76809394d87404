"""One durable turn running in this process: its numbered events, handed to this process's
subscribers at once and to the event log in PostgreSQL in batches (see runs.py for the whole
story). The event names and payloads are service/core/events.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Callable

from service.core import events
from service.core.errors import Cancelled, TurnstoreError
from service.core.events import RunEvent
from service.core.model import NewRun, RunCommit, RunEnd, RunStatus, Turn
from service.core.plans import TurnPlan
from service.core.translate import shown_items
from service.core.usage import Usage
from service.providers.base import ItemDone, TextDelta
from service.store.ports import RunReads, RunWrites
from service.usecases.exchange import ToolCalled
from service.usecases.turns import TurnDone, TurnEvent

log = logging.getLogger("turnstore.runs")

FLUSH_S = 0.05  # a watched run's events reach the log, and readers elsewhere, this soon
IDLE_FLUSH_S = 1.0  # an unwatched run's: what a replica that dies takes with it


class Run:
    """A durable turn running in this process."""

    def __init__(
        self, new: NewRun, plan: TurnPlan, correlation_id: str, writes: RunWrites, reads: RunReads
    ) -> None:
        self.new, self.id, self.plan = new, new.id, plan
        self.correlation_id = correlation_id
        self.events: list[RunEvent] = []
        self.finished = False
        self.stop_reason: TurnstoreError = Cancelled()
        self.task: asyncio.Task[None] | None = None
        # The revision the turn holds its conversation at, once it does (or why it never
        # did): a caller that answers only then (a /v1 stream) waits for it.
        self.held: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.held.add_done_callback(_retrieved)
        self.message_id: str | None = None  # the provider's id of the streamed message
        self.result: TurnDone | None = None  # how the turn ended, when it did here
        self._writes, self._reads = writes, reads
        self._logged = 0  # events[:_logged] are in the log
        self.begun = False  # its task has started (runs.py): it can be cancelled
        self.stopped_early = False  # stop() came before that: the task stops at its start
        self._flush_lock = asyncio.Lock()
        self._flush_timer: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()
        self._commit: RunCommit | None = None
        self._watched = False
        self._begun: asyncio.Task[None] | None = None  # its begin written (begin)

    async def begin(self, revision: int, *, written: bool = False) -> None:
        """The turn holds its conversation at ``revision``: written by its lease's statement
        (``written``), or else while its provider call starts (one round trip less before
        it), and waited for before its first event, its commit or its end is."""
        if written:
            self._held_at(revision)
            return
        self._begun = asyncio.get_running_loop().create_task(self._begin(revision))
        self._begun.add_done_callback(_retrieved)

    async def _begin(self, revision: int) -> None:
        await self._writes.begin_run(self.id, revision)
        self._held_at(revision)

    def _held_at(self, revision: int) -> None:
        if not self.held.done():
            self.held.set_result(revision)

    async def _begin_written(self) -> None:
        """Its begin, written: raises what writing it raised (the turn then fails). A turn
        cancelled meanwhile leaves it to finish (its end waits for it)."""
        begun = self._begun
        if begun is not None:
            if not begun.done():
                await asyncio.wait([begun])
            begun.result()

    async def record(self, event: TurnEvent) -> None:
        """What the turn did, as the event its client sees."""
        await self._begin_written()
        if isinstance(event, TextDelta):
            self.message_id = self.message_id or event.item_id
            self._publish(lambda seq: events.delta(seq, event.text))
        elif isinstance(event, ToolCalled):
            self._publish(lambda seq: events.tool_call(seq, event.name, event.status))
        elif isinstance(event, ItemDone):
            if self.plan.response is not None:  # a /v1 stream announces it; /api/v1 does not
                for item in shown_items(event.item):
                    self._publish(functools.partial(events.item_done, item=item))
        else:
            self.result = event
            await self._done(event)

    async def fail(self, status: RunStatus, error: TurnstoreError) -> None:
        """The turn ended without a commit: its terminal ``error`` event, logged with the
        run's end (published here even when logging it failed)."""
        if self._begun is not None:  # its end after its begin (which failed, perhaps)
            await asyncio.wait([self._begun])
        if not self.held.done():
            self.held.set_exception(error)
        if self.events and self.events[-1].terminal:
            return  # its end is out (only logging it failed): one terminal event, not two
        try:
            await self.end(
                status,
                error.code,
                error.message,
                lambda seq: events.failure(seq, error, self.correlation_id),
            )
        except TurnstoreError as exc:  # the database failed, or the owner was shredded
            log.warning(
                "turn %s: could not log its end (%s); readers will find it stalled",
                self.id,
                exc.code,
            )
        except Exception:
            log.exception("turn %s: could not log its end; readers will find it stalled", self.id)

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
        """Stop the turn, unless it has ended already (its terminal event is out: a client
        that leaves after message.done must not cancel a task that is only winding down)."""
        ended = self.finished or (self.events and self.events[-1].terminal)
        if self.task is not None and not ended:
            self.stop_reason = reason
            if self.begun:
                self.task.cancel()
            else:  # a task cancelled before its first step runs none of its cleanup
                self.stopped_early = True

    async def flush(self) -> None:
        async with self._flush_lock:
            batch = self.events[self._logged :]
            if batch:
                message_id = self.message_id if self._logged == 0 else None
                await self._writes.log_events(self.id, self.new.owner, batch, message_id)
                self._logged += len(batch)

    async def prepare_commit(self, turn: Turn) -> RunCommit:
        """What the turn's commit writes of this run (its events so far are logged first)."""
        await self._begin_written()
        self._cancel_timer()
        await self.flush()
        done = self._done_of(turn.status, turn.incomplete_reason, turn.usage)
        self._commit = RunCommit(self.id, turn.status, len(self.events) + 1, done)
        return self._commit

    async def end(
        self,
        status: RunStatus,
        code: str | None,
        message: str | None,
        terminal: Callable[[int], RunEvent],
        revision: int | None = None,
    ) -> None:
        """End without a commit of its own: the terminal event (``terminal`` of its number)
        after the others, logged with the end. Should the run have ended meanwhile
        (committed, interrupted elsewhere), what the log says is published here instead."""
        self._cancel_timer()
        if self.events and self.events[-1].terminal:
            return  # its client has had its one terminal event (an end that failed to log)
        last = terminal(len(self.events) + 1)
        async with self._flush_lock:
            batch = [*self.events[self._logged :], last]
            end = RunEnd(status, code, message, batch, revision)
            try:
                ended = await self._writes.end_run(self.id, self.new.owner, end)
            except Exception:
                # Its client here still gets its terminal event (the database failed, or its
                # owner was shredded and nothing more is written for them); readers elsewhere
                # will find the run stalled once its heartbeat runs out, or gone.
                self._add(last)
                raise
            if ended:
                self._add(last)
                self._logged = len(self.events)
                return
        await self.catch_up()
        if not self.events or not self.events[-1].terminal:
            # The log has no end for it: the run went with its conversation (deleted or
            # shredded meanwhile). Its client still gets exactly one terminal event.
            self._add(terminal(len(self.events) + 1))

    async def catch_up(self) -> None:
        """Publish what the log holds beyond what this process published."""
        found = await self._reads.run_events(self.id, self.new.owner, len(self.events))
        for event in found[1] if found else ():
            self._add(event)
        self._logged = len(self.events)

    def done(self) -> None:
        """The run's task has ended. Its client gets exactly one terminal event and a caller
        waiting for ``held`` an answer, however it ended: one that ended without (a failure
        nobody foresaw, in its very end) ends with an ``internal_error`` here."""
        if not self.events or not self.events[-1].terminal:
            self._add(events.failure(len(self.events) + 1, TurnstoreError(), self.correlation_id))
        if not self.held.done():
            self.held.set_exception(TurnstoreError())
        self.finished = True
        self._cancel_timer()
        self._changed.set()

    async def _done(self, done: TurnDone) -> None:
        """The turn ended with message.done: its commit logged it (publish it here too, as
        logged); or nothing was committed (the content filter), or an Idempotency-Key replay
        names an earlier commit: the run ends with it now."""
        commit = self._commit
        if commit is not None and done.revision is not None:
            self._add(commit.done.event(commit.done_seq, done.revision))
            self._logged = len(self.events)
            return
        pending = self._done_of(done.status, done.incomplete_reason, done.usage)
        if done.revision is None:
            filtered = "The content filter refused it."
            await self.end(
                "failed", "content_filtered", filtered, lambda seq: pending.event(seq, None)
            )
        else:
            revision = done.revision
            await self.end(
                done.status, None, None, lambda seq: pending.event(seq, revision), revision
            )

    def _done_of(
        self, status: str, incomplete_reason: str | None, usage: Usage | None
    ) -> events.Done:
        cid = self.plan.conversation_id
        return events.Done(status, incomplete_reason, cid, self.id, usage)

    def _publish(self, make: Callable[[int], RunEvent]) -> None:
        self._add(make(len(self.events) + 1))
        if self._flush_timer is None:
            delay = FLUSH_S if self._watched else IDLE_FLUSH_S
            self._flush_timer = asyncio.get_running_loop().call_later(delay, self._flush_soon)

    def _add(self, event: RunEvent) -> None:
        self.events.append(event)
        self._changed.set()

    def _flush_soon(self) -> None:
        self._flush_timer = None
        asyncio.get_running_loop().create_task(self._flush_logged())

    async def _flush_logged(self) -> None:
        """A flush in a task of its own: it never raises (its events stay for the next)."""
        try:
            await self.flush()
        except TurnstoreError:
            log.warning(
                "turn %s: could not log its events (they are kept for the next try)", self.id
            )
        except Exception:
            log.exception("turn %s: could not log its events (kept for the next try)", self.id)

    def _cancel_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None


def _retrieved(future: asyncio.Future[int] | asyncio.Future[None]) -> None:
    """Nobody need wait for ``held`` (only a /v1 stream does), nor for a begin whose turn
    failed first: its failure is not news."""
    if not future.cancelled():
        future.exception()
