"""The one way the PostgreSQL adapters reach the database: statements compiled once for
asyncpg (``sql``), run on the asyncpg connection under a pooled SQLAlchemy one (``driver``),
with one failure mapping."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import asyncpg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import QueuePool
from sqlalchemy.util import greenlet_spawn

from service.core.errors import StorageError
from service.platform.db import POOL_TIMEOUT_S

# What a database failure looks like, from SQLAlchemy or from the driver underneath it.
_FAILURES = (
    sa.exc.DBAPIError,
    sa.exc.TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    # A backend's FATAL that arrives while the connection is idle (the postmaster died first)
    # leaves asyncpg's protocol in a state whose next use raises this.
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)


READ_ONLY = "25006"  # read_only_sql_transaction: the statement did nothing
T = TypeVar("T")
Params = dict[str, Any]


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of asyncpg's own error, or of SQLAlchemy's wrapper of it."""
    state = getattr(exc, "sqlstate", None) or getattr(getattr(exc, "orig", None), "sqlstate", None)
    return state if isinstance(state, str) else None


@asynccontextmanager
async def _checked_out(engine: AsyncEngine) -> AsyncIterator[asyncpg.Connection]:
    """The asyncpg connection of a pooled one, straight from the engine's pool (its checkout
    check included, platform/db.py): one greenlet hop to check it out and one to give it back,
    where ``engine.connect()`` built a Connection and an AsyncConnection and made three (a
    plain turn's two statements spent 0.27 ms of server CPU more so, bench/README.md section
    8). Any database failure becomes StorageError, and the connection it happened on is
    discarded: after a failover or a restart the pool must not hand out a session that is
    read-only or half-dead. A read-only refusal discards every idle session: one opened while
    the database was read-only stays so after it is writable again."""
    limit = _limit(engine)
    try:
        if limit is not None and limit.locked():
            async with asyncio.timeout(POOL_TIMEOUT_S):
                await limit.acquire()
        elif limit is not None:
            await limit.acquire()  # free: taken without suspending
        try:
            fairy = await greenlet_spawn(engine.sync_engine.pool.connect)  # dispose() replaces it
            try:
                connection = fairy.driver_connection
                assert connection is not None  # a checked-out connection always has one
                yield connection
            except _FAILURES as exc:
                await greenlet_spawn(fairy.invalidate, exc)  # which gives it back
                raise
            except BaseException:
                await asyncio.shield(greenlet_spawn(fairy.close))  # cancelled: given back anyway
                raise
            await greenlet_spawn(fairy.close)
        finally:
            if limit is not None:
                limit.release()
    except _FAILURES as exc:
        state = sqlstate(exc)
        if state == READ_ONLY:
            await engine.dispose()
        raise StorageError(sqlstate=state) from exc


_limits: weakref.WeakKeyDictionary[sa.Engine, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]]
_limits = weakref.WeakKeyDictionary()


def _limit(engine: AsyncEngine) -> asyncio.Semaphore | None:
    """Turns wait for a connection here, in asyncio, rather than in the pool: a checkout then
    always finds a connection free, which SQLAlchemy's queue hands out without awaiting, where
    a wait in it is a greenlet switch, an ``asyncio.wait_for`` and a queue's futures (a plain
    turn at 32 turns in flight on a pool of 10 spent more on waiting there than on its two
    statements). One per engine and event loop; none for a pool without a fixed size."""
    sync, loop = engine.sync_engine, asyncio.get_running_loop()
    known = _limits.get(sync)
    if known is not None and known[0] is loop:
        return known[1]
    pool = sync.pool
    if not isinstance(pool, QueuePool) or pool.size() <= 0 or pool._max_overflow < 0:
        return None  # no limit to wait for
    limit = asyncio.Semaphore(pool.size() + pool._max_overflow)
    _limits[sync] = (loop, limit)
    return limit


async def written(write: Callable[[], Awaitable[T]]) -> T:
    """Run a write; if a read-only session refused it (it did nothing), run it once more on a
    fresh session, so the first write after the database is writable again succeeds. No
    other failure is retried: a lost COMMIT acknowledgement is not a failure to hide."""
    try:
        return await write()
    except StorageError as exc:
        if exc.sqlstate != READ_ONLY:
            raise
    return await write()


@asynccontextmanager
async def driver(engine: AsyncEngine, *, write: bool) -> AsyncIterator[asyncpg.Connection]:
    """The asyncpg connection under a pooled SQLAlchemy one: the pool's checkout check and the
    failure mapping, without SQLAlchemy's per-execution work. Without ``write`` each statement
    commits by itself (the engine autocommits, see platform/db.py: one statement is one round
    trip and sees one snapshot); ``write`` runs them in one READ COMMITTED transaction."""
    async with _checked_out(engine) as connection:
        if not write:
            yield connection
            return
        async with connection.transaction(isolation="read_committed"):
            yield connection


class Compiled:
    """A statement compiled once for asyncpg: its SQL, and its parameters in order."""

    def __init__(self, statement: sa.TextClause, dialect: sa.Dialect) -> None:
        # positiontup: the parameters' names in the order of $1, $2, ...
        compiled: Any = cast(Any, statement.compile(dialect=dialect))
        self.sql = str(compiled)
        self._names = tuple(compiled.positiontup or ())

    def args(self, params: Params) -> list[Any]:
        """The values for $1, $2, ... from ``params`` (which may hold more). A text
        statement's parameters have no type that would convert them: they go as they are."""
        return [params[name] for name in self._names]

    async def fetch(self, conn: asyncpg.Connection, params: Params) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await conn.fetch(self.sql, *self.args(params))
        return rows

    async def fetchrow(self, conn: asyncpg.Connection, params: Params) -> asyncpg.Record | None:
        return await conn.fetchrow(self.sql, *self.args(params))

    async def fetchval(self, conn: asyncpg.Connection, params: Params) -> Any:
        return await conn.fetchval(self.sql, *self.args(params))

    async def execute(self, conn: asyncpg.Connection, params: Params) -> None:
        await conn.execute(self.sql, *self.args(params))

    async def executemany(self, conn: asyncpg.Connection, rows: Iterable[Params]) -> None:
        await conn.executemany(self.sql, [self.args(row) for row in rows])


_DIALECT: sa.Dialect = asyncpg_dialect.dialect()  # type: ignore[no-untyped-call]


def sql(text: str) -> Compiled:
    """A statement written as SQL with ``:name`` parameters, compiled once for asyncpg (its
    whitespace folded: the source is laid out for people, the wire gets one line; so no
    ``--`` comments in it: say why in Python)."""
    if "--" in text:
        raise ValueError("a -- comment would swallow the rest of the folded statement")
    folded = " ".join(text.split()).replace("( ", "(").replace(" )", ")").replace(" ,", ",")
    return Compiled(sa.text(folded), _DIALECT)
