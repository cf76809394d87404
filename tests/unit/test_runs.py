"""Runs (durable turns) in one process, over the in-memory fake: what a run does at its end."""

from __future__ import annotations

from typing import Any

from service.core.errors import Cancelled
from service.core.events import GONE
from service.core.model import ANONYMOUS, RunEnd
from service.core.plans import PlanRules, chat_request, make_plan
from service.providers.fake import FakeProvider
from service.usecases.leases import Leases
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
