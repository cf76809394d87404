"""The engine behind PgBouncer in transaction pooling mode (Debian's 1.18: no prepared
statement support): DB_STATEMENT_CACHE_SIZE=0 leaves no prepared statement on any server
connection, the default cache breaks (the reason for the setting, and proof that the pooler
here really shares server connections), and a connection a pooler restart closed is replaced at checkout.
The whole service through PgBouncer is in tests/system/test_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.platform.db import create_engine
from tests.support.cluster import pgbouncer
from tests.support.database import asyncpg_dsn

_PROBE = sa.table("probe", sa.column("id", sa.Integer), sa.column("value", sa.Text))


async def _create_probe(url: str) -> None:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE probe (id int PRIMARY KEY, value text)"))
    finally:
        await engine.dispose()


async def _work(engine: AsyncEngine, worker: int, rounds: int = 10) -> None:
    """Short transactions with bind parameters, like the store's."""
    for n in range(rounds):
        key = worker * 1000 + n
        async with engine.begin() as conn:
            await conn.execute(sa.insert(_PROBE).values(id=key, value="a"))
            await conn.execute(sa.update(_PROBE).where(_PROBE.c.id == key).values(value="b"))
        async with engine.connect() as conn:
            assert await conn.scalar(sa.select(_PROBE.c.value).where(_PROBE.c.id == key)) == "b"


async def _prepared_statements(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(sa.text("SELECT count(*) FROM pg_prepared_statements")) or 0)


async def test_statement_cache_off_leaves_nothing_on_the_server_connections(
    empty_database: str,
) -> None:
    await _create_probe(empty_database)
    with pgbouncer(empty_database, pool_size=1) as pooled:  # one server connection for everyone
        engines = [create_engine(pooled, pool_size=3, statement_cache_size=0) for _ in range(2)]
        try:
            await asyncio.gather(*(_work(e, w) for w, e in enumerate(engines * 3)))
            assert await _prepared_statements(engines[0]) == 0
        finally:
            for engine in engines:
                await engine.dispose()


@asynccontextmanager
async def _in_transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A real transaction (the engine autocommits), holding one server connection throughout."""
    async with engine.connect() as conn:
        writing = await conn.execution_options(isolation_level="READ COMMITTED")
        async with writing.begin():
            yield writing


async def test_the_default_statement_cache_breaks_under_transaction_pooling(
    empty_database: str,
) -> None:
    """A statement cached on one server connection is not there on the next transaction's.
    Two raw clients steer which of the pooler's two server connections that is."""
    await _create_probe(empty_database)
    with pgbouncer(empty_database, pool_size=2) as pooled:
        engine = create_engine(pooled, pool_size=1)  # the default cache
        dsn = asyncpg_dsn(pooled)
        first, second = [await asyncpg.connect(dsn, statement_cache_size=0) for _ in range(2)]
        try:
            async with _in_transaction(engine) as conn:  # prepares and caches on server conn A
                await conn.execute(sa.select(_PROBE.c.value).where(_PROBE.c.id == 1))
                await first.execute("BEGIN")  # A is busy: this one holds B
            await second.execute("BEGIN")  # now this one holds A...
            await first.execute("COMMIT")  # ...and B is the only free one
            with pytest.raises(sa.exc.DBAPIError, match="prepared statement"):
                async with _in_transaction(engine) as conn:
                    await conn.execute(sa.select(_PROBE.c.value).where(_PROBE.c.id == 2))
        finally:
            for raw in (first, second):
                await raw.close()
            await engine.dispose()


async def test_connections_closed_by_a_pooler_restart_are_replaced_at_checkout(
    empty_database: str,
) -> None:
    await _create_probe(empty_database)
    engine = create_engine(empty_database, pool_size=1, statement_cache_size=0)  # replaced below
    try:
        with pgbouncer(empty_database, pool_size=1) as pooled:
            await engine.dispose()
            engine = create_engine(pooled, pool_size=1, statement_cache_size=0)
            await _work(engine, 0, rounds=1)  # the pool now holds one client connection
        # That pooler is gone, and with it the pooled connection; a new one takes its port.
        with pgbouncer(empty_database, pool_size=1, port=urlsplit(pooled).port):
            await _work(engine, 1)  # the dead one is never handed out (service/db.py)
    finally:
        await engine.dispose()
