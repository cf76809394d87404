"""The run-store contract (service/store/ports.py RunWrites and RunReads): durable turns' runs and their
events, run against PostgreSQL in clear and encrypted (tests/integration/test_run_store.py),
Citus (tests/system/test_citus.py) and the in-memory fake the unit tests use
(tests/unit/test_run_store.py), so the fake cannot drift from what the use cases rely on. Not
collected by itself: each importing module names its ``BACKENDS`` (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core import events
from service.core.errors import ConversationNotFound, PreconditionFailed
from service.core.events import RunEvent
from service.core.model import Append, NewRun, RunCommit, RunEnd, Turn
from service.store.ports import RunWrites
from service.store.postgres import PostgresStore, StoreConfig
from tests.support.backends import keyring_for
from tests.support.memory import MemoryStore

OWNER = "alice"
Stores = PostgresStore | MemoryStore  # each has the run ports and History


@pytest.fixture
def stores(request: pytest.FixtureRequest) -> Stores:
    """The run store of the backend ``request.param``; a commit that ends a run goes through
    the conversation store of the same backend."""
    if request.param == "memory":
        return MemoryStore(events_ttl_s=0.5)
    engine: AsyncEngine = request.getfixturevalue("engine")
    keyring = keyring_for(engine, request.param)
    return PostgresStore.over(engine, StoreConfig(events_ttl_s=0.5), keyring)


async def new_run(runs: RunWrites, *, heartbeat_s: float = 30, background: bool = False) -> NewRun:
    run = NewRun(uuid.uuid4(), uuid.uuid4(), OWNER, background)
    await runs.create_run(run, heartbeat_s)
    return run


def delta(seq: int, text: str) -> RunEvent:
    return events.delta(seq, text)


async def until(check: object, timeout_s: float = 10) -> None:
    """Poll an async predicate with a deadline (a heartbeat or a TTL running out)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_new_run_is_queued_and_only_its_owner_reads_it(stores: Stores) -> None:
    run = await new_run(stores.run_writes, background=True)
    view = await stores.run_reads.read_run(run.id, OWNER)
    assert view is not None
    assert (view.status, view.last_event, view.background, view.stalled) == (
        "queued", 0, True, False
    )  # fmt: skip
    assert view.conversation_id == run.conversation_id and not view.finished
    assert await stores.run_reads.read_run(run.id, "mallory") is None
    assert await stores.run_reads.run_events(run.id, "mallory", 0) is None
    assert await stores.run_reads.read_run(uuid.uuid4(), OWNER) is None


async def test_a_run_named_with_its_conversation_is_found_in_it_only(stores: Stores) -> None:
    """A caller that knows the run's conversation (a stored response's id carries it) names
    it: the run is found there, not as another conversation's."""
    run = await new_run(stores.run_writes)
    found = await stores.run_reads.read_run(run.id, OWNER, run.conversation_id)
    assert found is not None and found.conversation_id == run.conversation_id
    assert await stores.run_reads.read_run(run.id, OWNER, uuid.uuid4()) is None
    assert await stores.run_reads.read_run(run.id, OWNER) is not None


async def test_begun_and_logged_events_come_back_in_order_once(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    run = await new_run(runs)
    await runs.begin_run(run.id, 0)
    view = await reads.read_run(run.id, OWNER)
    assert view is not None and view.status == "in_progress"
    await runs.log_events(run.id, OWNER, [delta(1, "a"), delta(2, "b")])
    # A batch whose first try's outcome was unknown is logged again with more: no duplicates.
    await runs.log_events(run.id, OWNER, [delta(2, "b"), delta(3, "c")])
    found = await reads.run_events(run.id, OWNER, 0)
    assert found is not None
    view, logged = found
    assert [(e.seq, e.name, e.data) for e in logged] == [
        (1, "message.delta", '{"delta":"a"}'),
        (2, "message.delta", '{"delta":"b"}'),
        (3, "message.delta", '{"delta":"c"}'),
    ]
    assert view.last_event == 3
    after = await reads.run_events(run.id, OWNER, 2)
    assert after is not None and [e.seq for e in after[1]] == [3]


async def test_a_run_ends_once_with_its_terminal_event(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    run = await new_run(runs)
    await runs.log_events(run.id, OWNER, [delta(1, "a")])
    failed = events.error(2, "upstream_error", "no", "cid")
    end = RunEnd("failed", "upstream_error", "no", [failed])
    assert await runs.end_run(run.id, OWNER, end) is True
    assert await runs.end_run(run.id, OWNER, end) is False  # ended already
    view = await reads.read_run(run.id, OWNER)
    assert view is not None and view.finished
    assert (view.status, view.error_code, view.error_message) == ("failed", "upstream_error", "no")
    found = await reads.run_events(run.id, OWNER, 0)
    assert found is not None and [e.name for e in found[1]] == ["message.delta", "error"]
    await runs.log_events(run.id, OWNER, [delta(3, "late")])  # a finished run takes no more
    found = await reads.run_events(run.id, OWNER, 0)
    assert found is not None and [e.seq for e in found[1]] == [1, 2]


async def test_a_committed_turn_ends_its_run_in_the_commit(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    run = await new_run(runs)
    await runs.begin_run(run.id, 0)
    await runs.log_events(run.id, OWNER, [delta(1, "hi")])
    done = events.Done("completed", None, run.conversation_id, run.id)
    item = msgspec.Raw(b'{"type":"message","role":"user","content":"u"}')
    turn = Turn("u", "hi", [item])
    commit = RunCommit(run.id, "completed", 2, done)
    await stores.history.append(Append(run.conversation_id, turn, 0, owner=OWNER, run=commit))
    view = await reads.read_run(run.id, OWNER)
    assert view is not None
    assert (view.status, view.revision, view.message) == ("completed", 1, "hi")
    found = await reads.run_events(run.id, OWNER, 1)
    assert found is not None
    assert [(e.seq, e.name) for e in found[1]] == [(2, "message.done")]
    assert msgspec.json.decode(found[1][0].data)["revision"] == 1
    # Ended, it cannot end again: a late end of the same run changes nothing.
    end = RunEnd("failed", "cancelled", "late", [events.error(3, "cancelled", "late", "c")])
    assert await runs.end_run(run.id, OWNER, end) is False


async def test_a_run_in_an_existing_conversation_is_made_only_if_it_is_there(
    stores: Stores,
) -> None:
    """NewRun.existing: the early check of a streamed turn (its owner's conversation, at the
    revision If-Match lists), made with the run; nothing is recorded when it fails."""
    runs, reads = stores.run_writes, stores.run_reads
    cid = uuid.uuid4()
    item = msgspec.Raw(b'{"type":"message","role":"user","content":"u"}')
    await stores.history.append(Append(cid, Turn("u", "a", [item]), 0, owner=OWNER))

    def at(owner: str, conversation: uuid.UUID, if_match: frozenset[int] | None) -> NewRun:
        return NewRun(uuid.uuid4(), conversation, owner, False, existing=True, if_match=if_match)

    failing = [
        (at(OWNER, uuid.uuid4(), None), ConversationNotFound),
        (at("mallory", cid, None), ConversationNotFound),
        (at(OWNER, cid, frozenset({0, 2})), PreconditionFailed),
    ]
    for run, error in failing:
        with pytest.raises(error):
            await runs.create_run(run, 30)
        assert await reads.read_run(run.id, run.owner) is None
    for if_match in (None, frozenset({1})):
        run = at(OWNER, cid, if_match)
        assert await runs.create_run(run, 30) is True
        view = await reads.read_run(run.id, OWNER)
        assert view is not None and view.conversation_id == cid


async def test_cancelling_is_asked_of_unfinished_runs_of_the_owner(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    run, other = await new_run(runs), await new_run(runs)
    assert await runs.cancel_run(run.id, "mallory") is False
    assert await runs.cancel_run(run.id, OWNER) is True
    assert await reads.cancel_requested([run.id, other.id]) == {run.id}
    renewed = await runs.renew_runs([run.id, other.id], 30)
    assert renewed.cancelled == {run.id}
    end = RunEnd("cancelled", "cancelled", "stop", [events.error(1, "cancelled", "stop", "c")])
    assert await runs.end_run(run.id, OWNER, end)
    assert await runs.cancel_run(run.id, OWNER) is False  # finished


async def test_a_watched_run_is_reported_by_its_renewal(stores: Stores) -> None:
    runs = stores.run_writes
    run, other = await new_run(runs), await new_run(runs)
    await runs.watch_run(run.id)
    renewed = await runs.renew_runs([run.id, other.id], 30)
    assert renewed.watched == {run.id}


async def test_a_run_whose_heartbeat_ran_out_is_interrupted_once(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    error = events.error(0, "turn_interrupted", "gone", "c").data
    alive = await new_run(runs)
    assert await runs.interrupt_run(alive.id, OWNER, "gone", error) is False  # still alive
    run = await new_run(runs, heartbeat_s=0.05)
    await runs.log_events(run.id, OWNER, [delta(1, "a")])

    async def stalled() -> bool:
        view = await reads.read_run(run.id, OWNER)
        return view is not None and view.stalled

    await until(stalled)
    assert await runs.interrupt_run(run.id, OWNER, "gone", error) is True
    assert await runs.interrupt_run(run.id, OWNER, "gone", error) is False
    view = await reads.read_run(run.id, OWNER)
    assert view is not None
    assert (view.status, view.error_code, view.finished) == ("failed", "turn_interrupted", True)
    found = await reads.run_events(run.id, OWNER, 0)
    assert found is not None and [(e.seq, e.name) for e in found[1]] == [(1, "message.delta"),
                                                                        (2, "error")]  # fmt: skip


async def test_a_finished_runs_events_expire(stores: Stores) -> None:
    runs, reads = stores.run_writes, stores.run_reads
    run = await new_run(runs)
    end = RunEnd("failed", "upstream_error", "no", [events.error(1, "upstream_error", "no", "c")])
    assert await runs.end_run(run.id, OWNER, end)

    async def expired() -> bool:
        return await reads.read_run(run.id, OWNER) is None

    await until(expired)
    assert await reads.run_events(run.id, OWNER, 0) is None


async def test_a_run_records_where_it_began_its_message_and_its_response(
    stores: Stores,
) -> None:
    """What a /v1 stream needs to be rendered the same on any replica: the revision its turn
    held, the provider's id of the streamed message, the Response's echo."""
    runs, reads = stores.run_writes, stores.run_reads
    echo = msgspec.Raw(b'{"created_at":1.5,"tools":[],"fields":{}}')
    run = NewRun(uuid.uuid4(), uuid.uuid4(), OWNER, False, echo)
    await runs.create_run(run, 30)
    await runs.begin_run(run.id, 4)
    await runs.log_events(run.id, OWNER, [delta(1, "a")], "msg_1")
    await runs.log_events(run.id, OWNER, [delta(2, "b")], "msg_other")  # known already: kept
    view = await reads.read_run(run.id, OWNER)
    assert view is not None
    assert (view.base_revision, view.message_id) == (4, "msg_1")
    assert view.response is not None and bytes(view.response) == bytes(echo)
    assert view.created_at is not None
    assert await reads.find_run(run.conversation_id, OWNER, 4) == run.id
    assert await reads.find_run(run.conversation_id, OWNER, 3) is None
    assert await reads.find_run(run.conversation_id, "mallory", 4) is None


async def test_the_run_at_a_revision_is_one_that_did_not_fail_first(stores: Stores) -> None:
    """Two runs held the conversation at one revision: the later was refused after its lease
    began it (before its provider call), while the earlier runs on. The earlier one is the
    run at that revision (a /v1 stream's response id names it)."""
    runs, reads = stores.run_writes, stores.run_reads
    cid = uuid.uuid4()
    running = NewRun(uuid.uuid4(), cid, OWNER, False, None)
    await runs.create_run(running, 30)
    refused = NewRun(uuid.uuid4(), cid, OWNER, False, None)
    await runs.create_run(refused, 30)
    await runs.begin_run(refused.id, 4)
    end = RunEnd("failed", "conversation_full", "full", [events.error(1, "x", "full", "c")])
    assert await runs.end_run(refused.id, OWNER, end) is True
    await runs.begin_run(running.id, 4)
    assert await reads.find_run(cid, OWNER, 4) == running.id
