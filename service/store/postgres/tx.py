"""Short transactions with one failure mapping, shared by the PostgreSQL adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.core.errors import StorageError

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


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of asyncpg's own error, or of SQLAlchemy's wrapper of it."""
    state = getattr(exc, "sqlstate", None) or getattr(getattr(exc, "orig", None), "sqlstate", None)
    return state if isinstance(state, str) else None


@asynccontextmanager
async def _checked_out(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A pooled connection. Any database failure becomes StorageError, and the connection it
    happened on is discarded: after a failover or a restart the pool must not hand out a
    session that is read-only or half-dead. A read-only refusal discards every idle session:
    one opened while the database was read-only stays so after it is writable again."""
    try:
        async with engine.connect() as conn:
            try:
                yield conn
            except _FAILURES:
                await conn.invalidate()
                raise
    except _FAILURES as exc:
        state = sqlstate(exc)
        if state == READ_ONLY:
            await engine.dispose()
        raise StorageError(sqlstate=state) from exc


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
async def read(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A one-statement read on the engine's autocommit connection: no BEGIN/COMMIT round trips
    (one statement sees one snapshot anyway)."""
    async with _checked_out(engine) as conn:
        yield conn


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One short transaction (the engine autocommits, see service/db.py)."""
    async with _checked_out(engine) as conn:
        writing = await conn.execution_options(isolation_level="READ COMMITTED")
        async with writing.begin():
            yield writing


@asynccontextmanager
async def driver(engine: AsyncEngine, *, write: bool) -> AsyncIterator[asyncpg.Connection]:
    """The asyncpg connection under a pooled SQLAlchemy one, for the hot path's statements
    (compiled once by SQLAlchemy Core, see ``Compiled``): the same pool, checkout check and failure
    mapping, without Core's per-execution work. ``write`` runs it in one transaction."""
    async with _checked_out(engine) as conn:
        connection = (await conn.get_raw_connection()).driver_connection
        assert connection is not None  # a checked-out connection always has one
        if not write:
            yield connection
            return
        async with connection.transaction():
            yield connection


class Compiled:
    """A Core statement compiled once for asyncpg: its SQL, and its parameters in order."""

    def __init__(
        self, statement: sa.Executable, dialect: sa.Dialect, columns: list[str] | None = None
    ) -> None:
        # ``columns``: the columns an INSERT gets values for (as in an execution's parameters).
        self._compiled = statement.compile(dialect=dialect, column_keys=columns)  # type: ignore[attr-defined]
        self.sql = str(self._compiled)
        self._names = tuple(self._compiled.positiontup or ())

    def args(self, params: dict[str, Any]) -> list[Any]:
        values = self._compiled.construct_params(params)
        return [values[name] for name in self._names]
