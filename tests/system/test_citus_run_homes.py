"""A durable turn found by its id on Citus from a replica that never saw it (issue 44,
deploy/SCALE-OUT.md "A run found by its id"): the replica reads the run's conversation in its
home (run_homes, on the coordinator) and sends the run's statements to that conversation's
worker only. So with the other worker stopped, a replica behind a load balancer still reads the
turn's status, follows its events and cancels it, with no two-phase commit; a run without a home
(made by the release before) is looked for on every shard once, by a read, and then the same.

Each test starts a cluster of its own (tests/support/citus.py): one stops a worker."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import ExitStack

import asyncpg
import pytest

from service.core import events as run_events
from service.core.model import NewRun, Removal, RunEnd
from service.platform import migrate
from service.platform.db import create_engine
from service.store.postgres import PostgresStore
from service.store.postgres.placement import distribute
from tests.support.citus import (
    CitusCluster,
    Node,
    citus_cluster,
    citus_database,
    require_citus,
    restarted,
    stop,
)
from tests.support.database import connected
from tests.support.events import TURNS, background, follow
from tests.support.fakeapi import Script
from tests.support.helpers import CHAT
from tests.support.turn_kinds import Replica, replica

pytestmark = pytest.mark.citus

WHERE = (
    "SELECT nodeport FROM citus_shards"
    " WHERE shardid = get_shard_id_for_distribution_column('conversations', $1::text)"
)


def test_a_replica_that_never_saw_a_turn_needs_only_its_conversations_worker() -> None:
    """Status, events and cancel from the other replica, the worker that does not hold the
    conversation stopped: each answers as with both up (a statement on every shard would
    fail), and nothing made a two-phase commit."""
    require_citus()
    with citus_cluster() as cluster, ExitStack() as later, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        stopped = asyncio.run(_from_elsewhere(url, cluster))
        assert stopped is not None
        later.enter_context(restarted(stopped))  # for the database's drop


def test_a_turn_without_a_home_is_found_by_its_id() -> None:
    """A run made by the release before (no home): found, followed and cancelled from the
    other replica all the same, still without a two-phase commit (found by one read over every
    shard, then named by its conversation: a cancel is not an UPDATE of every shard); a turn
    found nowhere is 404, a cancel of it too."""
    require_citus()
    with citus_cluster() as cluster, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        asyncio.run(_from_elsewhere(url, None, homeless=True))


def test_a_runs_home_goes_with_it() -> None:
    """Forgotten, deleted with its conversation, expired, deleted with its owner's rows: the
    run's home too (on plain PostgreSQL nothing is written there)."""
    require_citus()
    with citus_cluster() as cluster, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        asyncio.run(_homes_go(url))


async def _from_elsewhere(
    url: str, cluster: CitusCluster | None, homeless: bool = False
) -> Node | None:
    """The worker stopped (with ``cluster``), once it is done."""
    # Its runs renewed every second, not every third of one: the other replica must not find
    # the run stalled (and end it as interrupted) because a loaded machine held a renewal.
    slow = {"held_s": 0, "turn_lease_s": 3.0}
    async with replica(url, **slow) as a, replica(url, **slow) as b, connected(url) as db:
        made = await a.client.post(CHAT, json={"message": "first"})
        assert made.status_code == 200, made.text
        cid = made.json()["conversation_id"]
        stall = asyncio.Event()
        stalled = Script(text="never finished", deltas=4, stall=stall)
        a.api.then(stalled)
        before = await _two_phase(db)  # the run made with its home, then read elsewhere
        turn = (await background(a.client, message="stop me", conversation_id=cid))["turn_id"]
        await stalled.started.wait()
        assert await db.fetchval("SELECT count(*) FROM run_homes") == 1
        if homeless:
            await db.execute("DELETE FROM run_homes")
        stopped = None
        if cluster is not None:  # the worker that does not hold the conversation
            port = await db.fetchval(WHERE, cid)
            stopped = next(worker for worker in cluster.workers if worker.port != port)
            stop(stopped)
        try:
            await _status_events_cancel(b, turn)
        finally:
            stall.set()
        if homeless:  # a turn found nowhere: looked for on every shard (both workers up)
            missing = await b.client.get(f"{TURNS}/{uuid.uuid4()}")
            assert missing.status_code == 404, missing.text
            missing = await b.client.post(f"{TURNS}/{uuid.uuid4()}/cancel")
            assert missing.status_code == 404, missing.text
        assert await _two_phase(db) == before
    return stopped


async def _status_events_cancel(b: Replica, turn: str) -> None:
    status = await b.client.get(f"{TURNS}/{turn}")
    assert status.status_code == 200, status.text
    assert status.json()["status"] in ("queued", "in_progress"), status.text
    following = asyncio.create_task(follow(b.client, turn))  # watches the run: an UPDATE
    cancelled = await b.client.post(f"{TURNS}/{turn}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled", cancelled.text
    events = await asyncio.wait_for(following, 15)
    assert events[-1].name == "error" and events[-1].data["error"]["code"] == "cancelled"
    again = await b.client.get(f"{TURNS}/{turn}")
    assert again.json()["status"] == "cancelled", again.text


async def _homes_go(url: str) -> None:
    engine = create_engine(url, pool_size=2)
    try:
        store = PostgresStore.over(engine)
        async with connected(url) as db:

            async def made(owner: str = "alice") -> tuple[uuid.UUID, uuid.UUID]:
                cid = uuid.uuid4()
                await db.execute(
                    "INSERT INTO conversations (id, revision, created_at, updated_at, owner)"
                    " VALUES ($1, 1, now(), now(), $2)",
                    cid,
                    owner,
                )
                run = NewRun(uuid.uuid4(), cid, owner, True)
                assert await store.run_writes.create_run(run, 30)
                end = RunEnd("failed", "turn_failed", "failed", [run_events.delta(1, "x")])
                await store.run_writes.end_run(run.id, owner, end)
                return cid, run.id

            async def homes() -> int:
                return int(await db.fetchval("SELECT count(*) FROM run_homes"))

            _, forgotten = await made()
            await store.run_writes.forget_run(forgotten, "alice")
            assert await homes() == 0
            cid, _ = await made()
            await store.history.delete(Removal(cid, "alice"))
            assert await homes() == 0
            await made()
            await db.execute("UPDATE turn_runs SET expires_at = now() - interval '1 second'")
            await store.ops.purge()
            assert await homes() == 0
            await made("bob")
            await made("bob")
            await store.owners.delete_owner("bob")
            assert await homes() == 0
            assert await store.owners.owner_rows("bob") == 0
    finally:
        await engine.dispose()


async def _two_phase(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM pg_dist_transaction"))
