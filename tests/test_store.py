"""The store contract, against real PostgreSQL: conditional append, races, delete, failures."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db import create_engine
from service.errors import (
    ConversationConflict,
    ConversationNotFound,
    PreconditionFailed,
    StorageError,
)
from service.model import Turn
from service.store.postgres import PostgresStore


def turn(n: int) -> Turn:
    items = [
        msgspec.Raw(b'{"type":"message","role":"user","content":"u%d"}' % n),
        # Key order, spacing and escapes must survive: the provider's bytes, not a re-encoding.
        msgspec.Raw(
            b'{"type":"reasoning","summary":[],"encrypted_content":"gA\\u00e9%d==" , "id":"rs"}' % n
        ),
    ]
    return Turn(f"user {n} \N{SNOWMAN}", f"assistant {n}", items)


async def count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text(f"SELECT count(*) FROM {table}")) or 0)


async def test_unknown_conversation_loads_as_none(store: PostgresStore) -> None:
    assert await store.load(uuid.uuid4()) is None


async def test_appends_turns_in_order_and_keeps_replay_bytes(store: PostgresStore) -> None:
    cid = uuid.uuid4()
    for n in range(1, 4):
        commit = await store.append(cid, turn(n), expected_revision=n - 1)
        assert commit.revision == n
    loaded = await store.load(cid)
    assert loaded is not None
    assert loaded.revision == 3
    assert [t.user_message for t in loaded.turns] == [turn(n).user_message for n in (1, 2, 3)]
    expected = [bytes(item) for n in (1, 2, 3) for item in turn(n).replay_items]
    assert [bytes(item) for item in loaded.replay_items] == expected


async def test_stale_expected_revision_conflicts_and_writes_nothing(
    store: PostgresStore, engine: AsyncEngine
) -> None:
    cid = uuid.uuid4()
    await store.append(cid, turn(1), 0)
    await store.append(cid, turn(2), 1)
    with pytest.raises(ConversationConflict):
        await store.append(cid, turn(3), 1)
    with pytest.raises(ConversationConflict):
        await store.append(cid, turn(3), 0)  # "new" conversation whose id exists
    loaded = await store.load(cid)
    assert loaded is not None and loaded.revision == 2
    assert await count(engine, "turns") == 2


async def test_append_to_deleted_conversation_is_not_found(store: PostgresStore) -> None:
    cid = uuid.uuid4()
    await store.append(cid, turn(1), 0)
    await store.delete(cid)
    with pytest.raises(ConversationNotFound):
        await store.append(cid, turn(2), 1)


async def test_delete_removes_transcript_and_replay_items(
    store: PostgresStore, engine: AsyncEngine
) -> None:
    keep, gone = uuid.uuid4(), uuid.uuid4()
    for cid in (keep, gone):
        await store.append(cid, turn(1), 0)
        await store.append(cid, turn(2), 1)
    await store.delete(gone)
    assert await store.load(gone) is None
    assert await count(engine, "turns") == 2
    with pytest.raises(ConversationNotFound):
        await store.delete(gone)
    loaded = await store.load(keep)
    assert loaded is not None and loaded.revision == 2


async def test_delete_honours_if_match(store: PostgresStore) -> None:
    cid = uuid.uuid4()
    await store.append(cid, turn(1), 0)
    with pytest.raises(PreconditionFailed):
        await store.delete(cid, if_match=frozenset({2}))
    assert await store.load(cid) is not None
    await store.delete(cid, if_match=frozenset({1}))
    assert await store.load(cid) is None


async def _wait_for_lock_waiters(engine: AsyncEngine, expected: int) -> None:
    """Poll pg_stat_activity until `expected` backends wait on a lock (bounded, no sleep race)."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
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
        await store.append(cid, turn(1), 0)
        expected = 1
    # Two replicas: separate pools. A third connection holds the row (or the key) so both
    # appends are provably inside their transactions, blocked, before either can commit.
    replicas = [create_engine(database_url, pool_size=1) for _ in range(2)]
    stores = [PostgresStore(e) for e in replicas]
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
                asyncio.create_task(s.append(cid, turn(n), expected))
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
    loaded = await store.load(cid)
    assert loaded is not None
    assert loaded.revision == expected + 1
    assert len(loaded.turns) == expected + 1  # the loser's turn row is not there
    assert await count(engine, "turns") == expected + 1


async def test_unreachable_database_is_a_storage_error() -> None:
    engine = create_engine("postgresql://nobody@127.0.0.1:1/none")
    store = PostgresStore(engine)
    try:
        with pytest.raises(StorageError):
            await store.load(uuid.uuid4())
        with pytest.raises(StorageError):
            await store.append(uuid.uuid4(), turn(1), 0)
    finally:
        await store.close()
