"""Runs (durable turns) in one process, over the in-memory fake: what a run does at its end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from service.core.errors import Cancelled, StorageError, UpstreamError
from service.core.events import GONE
from service.core.model import ANONYMOUS, RunEnd
from service.core.plans import PlanRules, chat_request, make_plan
from service.providers.base import ProviderEvent, ProviderRequest
from service.providers.fake import FakeProvider
from service.usecases.leases import Leases
from service.usecases.run import Run
from service.usecases.runs import TurnRuns
from service.usecases.turns import TurnService
from tests.support.memory import MemoryStore


class CountingStore(MemoryStore):
    """The fake, counting how often a run is ended without a commit."""

    ends = 0

    async def end_run(self, run_id: Any, owner: str, end: RunEnd) -> bool:
        self.ends += 1
        return await super().end_run(run_id, owner, end)


async def test_a_client_leaving_after_message_done_does_not_end_the_run_again() -> None:
    """A streamed turn's client goes away once it has message.done (its stream closes): the
    committed run is only winding down and must not be cancelled into a second end (which
    cost an END and a READ_EVENTS per streamed turn)."""
    store = CountingStore()
    turns = TurnService(store, FakeProvider(), leases=Leases(store, store, store.notifications))
    runs = TurnRuns(turns, store, store, store.notifications, heartbeat_s=30)
    plan = make_plan(PlanRules(), chat_request(ANONYMOUS, "hi", None, None))
    started = await runs.start(plan, correlation_id="cid")
    run = started.run
    assert run is not None
    async for event in run.follow():
        if event.terminal:
            run.stop(Cancelled(GONE))  # what the stream's close does
            break
    assert run.task is not None
    await run.task
    assert not run.task.cancelled() and store.ends == 0
    assert [event.name for event in run.events][-1] == "message.done"
    await runs.close(1)


class Failing(FakeProvider):
    """The built-in fake, whose provider fails every call."""

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        raise UpstreamError("the provider failed")
        yield  # an async generator, as the port's


class SlowToFree(MemoryStore):
    """The fake, whose giving a running turn's place back waits for ``freed`` to be set."""

    def __init__(self) -> None:
        super().__init__()
        self.freeing = asyncio.Event()
        self.freed = asyncio.Event()

    async def free_turn(self, owner: str, holder: Any) -> None:
        self.freeing.set()
        await self.freed.wait()
        await super().free_turn(owner, holder)


async def test_a_failed_runs_place_is_back_before_its_terminal_event() -> None:
    """A client that reads a failed turn's end may start its next turn at once: the run gives
    its place back first, then publishes its error (the other order answered that next turn
    429 too_many_requests under load)."""
    store = SlowToFree()
    turns = TurnService(store, Failing(), leases=Leases(store, store, store.notifications))
    runs = TurnRuns(turns, store, store, store.notifications, heartbeat_s=30)
    plan = make_plan(PlanRules(), chat_request(ANONYMOUS, "hi", None, None))
    started = await runs.start(plan, correlation_id="cid")
    run = started.run
    assert run is not None
    await store.freeing.wait()  # the run ended and is giving its place back
    assert not any(event.terminal for event in run.events)  # nothing said yet: not free yet
    store.freed.set()
    assert run.task is not None
    await run.task
    assert [event.name for event in run.events][-1] == "error"
    await runs.close(1)


async def test_a_run_stopped_before_its_task_began_ends_and_gives_its_place_back() -> None:
    """A background turn cancelled at once (before its task ran a step) ends cancelled and
    gives its place back: a task cancelled before its first step runs none of its cleanup,
    so its place stayed held for its lease (the owner's next turn waited 30 s)."""
    store = MemoryStore()
    runs, run = await _started(store, FakeProvider())
    run.stop(Cancelled())  # no await between: its task has not run yet
    await run.task
    assert [event.name for event in run.events] == ["error"]
    assert not store._running.get(ANONYMOUS)  # its place is back
    await runs.close(1)


class SlowToBegin(MemoryStore):
    """The fake, whose writing a run's begin waits for ``written`` (and then fails, with
    ``fails``)."""

    def __init__(self, fails: bool = False) -> None:
        super().__init__()
        self.written = asyncio.Event()
        self.fails = fails

    async def begin_run(self, run_id: Any, revision: int) -> None:
        await self.written.wait()
        if self.fails:
            raise StorageError()
        await super().begin_run(run_id, revision)


class Asked(FakeProvider):
    """The built-in fake, which says when its provider call started."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        self.asked.set()
        async for event in super().respond(request, stream=stream):
            yield event


async def test_a_runs_provider_call_starts_while_its_begin_is_written() -> None:
    """Writing a run's begin (its revision) is one round trip less before the provider call:
    the call starts meanwhile, and the turn's first event waits for it."""
    store, provider = SlowToBegin(), Asked()
    runs, run = await _started(store, provider)
    await asyncio.wait_for(provider.asked.wait(), 5)  # the begin is not written yet
    assert run.events == [] and not run.held.done()
    store.written.set()
    await run.task
    assert [event.name for event in run.events][-1] == "message.done"
    assert run.held.result() == 0
    await runs.close(1)


async def test_a_run_whose_begin_fails_fails_without_a_commit() -> None:
    store = SlowToBegin(fails=True)
    runs, run = await _started(store, Asked())
    store.written.set()
    await run.task
    assert [event.name for event in run.events] == ["error"]
    assert json.loads(run.events[0].data)["error"]["code"] == "storage_error"
    assert await store.describe(run.plan.conversation_id, ANONYMOUS) is None  # none committed
    await runs.close(1)


async def _started(store: MemoryStore, provider: FakeProvider) -> tuple[TurnRuns, Run]:
    """A run of a new conversation's turn, started over ``store`` and ``provider``."""
    turns = TurnService(store, provider, leases=Leases(store, store, store.notifications))
    runs = TurnRuns(turns, store, store, store.notifications, heartbeat_s=30)
    plan = make_plan(PlanRules(), chat_request(ANONYMOUS, "hi", None, None))
    run = (await runs.start(plan, correlation_id="cid")).run
    assert run is not None and run.task is not None
    return runs, run
