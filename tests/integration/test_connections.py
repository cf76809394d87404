"""How the store's statements get their connections (service/store/postgres/tx.py): a
connection an earlier statement gave back is lent again without going through SQLAlchemy's
pool, and yet it is the pool's: a connection the server closed while idle is not handed out,
``engine.dispose()`` closes the idle ones, and a pool's size still bounds them. Real
PostgreSQL, real connections."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform.db import create_engine
from service.store.postgres.tx import driver, in_use
from tests.support.database import asyncpg_dsn


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine of two connections at most."""
    pool = create_engine(database_url, pool_size=2)
    try:
        yield pool
    finally:
        await pool.dispose()


@pytest.fixture
async def admin(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield conn
    finally:
        await conn.close()


async def _backend(pool: AsyncEngine) -> int:
    async with driver(pool, write=False) as conn:
        return int(await conn.fetchval("SELECT pg_backend_pid()"))


async def _gone(admin: asyncpg.Connection, pid: int) -> bool:
    """Whether the backend ``pid`` has ended (within 10 s: a closed one ends at once)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_connection_given_back_is_lent_again_and_counts_as_idle(
    pool: AsyncEngine,
) -> None:
    first = await _backend(pool)
    assert await _backend(pool) == first  # the same session, not a new one
    assert in_use(pool) == 0  # idle here is not in use
    async with driver(pool, write=True) as conn:
        assert in_use(pool) == 1
        assert await conn.fetchval("SELECT pg_backend_pid()") == first


async def test_a_connection_the_server_closed_while_idle_is_not_lent(
    pool: AsyncEngine, admin: asyncpg.Connection
) -> None:
    async with driver(pool, write=False) as conn:  # then idle, lent to this loop
        pid = int(await conn.fetchval("SELECT pg_backend_pid()"))
    closed = asyncio.Event()
    conn.add_termination_listener(lambda _: closed.set())
    assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    # Until asyncpg has read the close there is a moment (the server's FATAL read, its end of
    # the connection not yet) in which no check without a round trip can tell: a statement
    # then fails once and its connection is discarded. This is the connection closed while
    # idle, as a pooled connection is once a server restarts or a pooler recycles it.
    await asyncio.wait_for(closed.wait(), timeout=10)
    # The next statement runs, on another session: no storage_error for the closed one.
    assert await _backend(pool) not in (pid, None)


async def test_dispose_closes_the_idle_connections(
    pool: AsyncEngine, admin: asyncpg.Connection
) -> None:
    both = asyncio.Barrier(2)

    async def hold() -> int:
        async with driver(pool, write=False) as conn:
            await both.wait()  # both held at once: two sessions
            return int(await conn.fetchval("SELECT pg_backend_pid()"))

    pids = set(await asyncio.gather(hold(), hold()))
    assert len(pids) == 2
    await pool.dispose()
    assert [await _gone(admin, pid) for pid in pids] == [True, True]
    assert await _backend(pool) not in pids  # and the pool works on afterwards


async def test_no_more_connections_than_the_pool_holds(
    pool: AsyncEngine, admin: asyncpg.Connection
) -> None:
    seen: set[int] = set()
    most = 0

    async def statement() -> None:
        nonlocal most
        async with driver(pool, write=False) as conn:
            most = max(most, in_use(pool))
            seen.add(int(await conn.fetchval("SELECT pg_backend_pid()")))

    await asyncio.gather(*(statement() for _ in range(20)))
    assert most == 2 and len(seen) == 2


async def test_an_engine_that_lent_connections_is_collected_once_dropped(database_url: str) -> None:
    engine = create_engine(database_url, pool_size=1)
    await _backend(engine)
    await engine.dispose()
    collected = weakref.ref(engine.sync_engine)
    del engine
    gc.collect()
    assert collected() is None  # what this loop was lent does not keep it alive
