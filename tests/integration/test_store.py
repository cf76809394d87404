"""The store contract over PostgreSQL, in clear and encrypted (tests/contracts/store.py), and what
only a real database shows: races of real transactions, a lease racing a commit, an unreachable
database."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import (
    ConversationConflict,
    StorageError,
)
from service.core.model import (
    ANONYMOUS,
    Append,
    LeaseRequest,
)
from service.platform.db import create_engine
from service.store.postgres import PostgresStore, StoreConfig
from tests.contracts.store import *  # noqa: F403
from tests.contracts.store import count, turn

BACKENDS = ("postgres", "postgres-encrypted")


async def _wait_for_lock_waiters(engine: AsyncEngine, expected: int) -> None:
    """Poll until `expected` backends wait on a lock (bounded, no sleep race): in
    pg_stat_activity, or on Citus in citus_stat_activity (a lock wait happens on a worker)."""
    async with engine.connect() as conn:
        citus = await conn.scalar(text("SELECT to_regclass('citus_stat_activity') IS NOT NULL"))
    view = "citus_stat_activity" if citus else "pg_stat_activity"
    query = text(
        f"SELECT count(*) FROM {view} "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    for _ in range(500):
        async with engine.connect() as conn:
            if await conn.scalar(query) == expected:
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {expected} transactions waiting on the row lock")


@pytest.mark.parametrize("existing", [True, False], ids=["next-turn", "first-turn"])
async def test_two_real_transactions_race_exactly_one_wins(
    database_url: str, store: PostgresStore, engine: AsyncEngine, existing: bool
) -> None:
    cid = uuid.uuid4()
    expected = 0
    if existing:
        await store.history.append(Append(cid, turn(1), 0))
        expected = 1
    # Two replicas: separate pools. A third connection holds the row (or the key) so both
    # appends are provably inside their transactions, blocked, before either can commit.
    replicas = [create_engine(database_url, pool_size=1) for _ in range(2)]
    stores = [PostgresStore.over(e) for e in replicas]
    try:
        async with engine.connect() as blocker:
            blocker = await blocker.execution_options(isolation_level="READ COMMITTED")
            await blocker.begin()
            if existing:
                await blocker.execute(
                    text("SELECT 1 FROM conversations WHERE id = :id FOR UPDATE"), {"id": cid}
                )
            else:
                await blocker.execute(
                    text("INSERT INTO conversations VALUES (:id, 99, now(), now())"), {"id": cid}
                )
            racers = [
                asyncio.create_task(s.history.append(Append(cid, turn(n), expected)))
                for n, s in zip((7, 8), stores, strict=True)
            ]
            await _wait_for_lock_waiters(engine, 2)
            await blocker.rollback()
        results = await asyncio.gather(*racers, return_exceptions=True)
    finally:
        for e in replicas:
            await e.dispose()
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1, results
    assert len(losers) == 1 and isinstance(losers[0], ConversationConflict), results
    loaded = await store.history.load(cid)
    assert loaded is not None
    assert loaded.revision == expected + 1
    assert len(loaded.turns) == expected + 1  # the loser's turn row is not there
    assert await count(engine, "turns") == expected + 1


async def test_unreachable_database_is_a_storage_error() -> None:
    engine = create_engine("postgresql://nobody@127.0.0.1:1/none")
    store = PostgresStore.over(engine)
    try:
        with pytest.raises(StorageError):
            await store.history.load(uuid.uuid4())
        with pytest.raises(StorageError):
            await store.history.append(Append(uuid.uuid4(), turn(1), 0))
    finally:
        await engine.dispose()


async def test_a_lease_racing_a_commit_never_returns_a_revision_ahead_of_its_turns(
    store: PostgresStore, engine: AsyncEngine
) -> None:
    """The lease statement reads turns in its snapshot but the revision from the row it
    updated, which a commit may have changed while the statement waited for its row lock.
    Returned as it came, the history cache would keep a revision without its turn for good."""
    cid = uuid.uuid4()
    await store.history.append(Append(cid, turn(1), 0))
    row = {
        "cid": cid, "items": "[]", "user": "u2", "assistant": "a2",
    }  # fmt: skip
    async with engine.connect() as blocker:
        blocker = await blocker.execution_options(isolation_level="READ COMMITTED")
        await blocker.begin()
        await blocker.execute(
            text("UPDATE conversations SET revision = 2 WHERE id = :cid"), {"cid": cid}
        )
        await blocker.execute(
            text(
                "INSERT INTO turns (conversation_id, seq, user_message, assistant_message, "
                "replay_items, created_at, status) "
                "VALUES (:cid, 2, :user, :assistant, CAST(:items AS json), now(), 'completed')"
            ),
            row,
        )
        leasing = asyncio.create_task(
            store.history.lease(
                LeaseRequest(cid, "anonymous", uuid.uuid4(), lease_s=30, queue=False)
            )
        )
        await _wait_for_lock_waiters(engine, 1)  # its snapshot is taken: turn 2 is not in it
        await blocker.commit()
    attempt = await leasing
    assert attempt.acquired and attempt.conversation is not None
    assert attempt.conversation.revision == 2
    assert [t.user_message for t in attempt.conversation.turns] == [turn(1).user_message, "u2"]


async def test_a_lease_given_back_while_the_lease_statement_waits_is_taken(
    engine: AsyncEngine,
) -> None:
    """Another turn's lease is given back (its commit) while this lease statement waits for
    the row: the statement's snapshot saw it taken, so it took no place among the running
    turns; the lease is still this turn's, place and all (with TURN_CONCURRENCY=reject it was
    refused as busy)."""
    store, cid, other = (
        PostgresStore.over(engine, StoreConfig(running_turns=4)),
        uuid.uuid4(),
        uuid.uuid4(),
    )
    await store.history.append(Append(cid, turn(1), 0))
    ask = LeaseRequest(cid, ANONYMOUS, other, lease_s=30, queue=False)
    assert (await store.history.lease(ask)).acquired
    async with engine.connect() as blocker:
        blocker = await blocker.execution_options(isolation_level="READ COMMITTED")
        await blocker.begin()
        await blocker.execute(
            text("UPDATE conversations SET lease_holder = NULL WHERE id = :cid"), {"cid": cid}
        )
        mine = uuid.uuid4()
        leasing = asyncio.create_task(store.history.lease(replace(ask, holder=mine)))
        await _wait_for_lock_waiters(engine, 1)  # its snapshot is taken: the lease is held
        await blocker.commit()
    attempt = await leasing
    assert attempt.acquired and not attempt.crowded
    async with engine.connect() as conn:
        placed = await conn.execute(
            text("SELECT count(*) FROM owner_turns WHERE holder = :h"), {"h": mine}
        )
        assert placed.scalar_one() == 1
