"""Short transactions with one failure mapping, shared by the PostgreSQL adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.errors import StorageError


@asynccontextmanager
async def read(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A one-statement read on the engine's autocommit connection: no BEGIN/COMMIT round trips
    (one statement sees one snapshot anyway). Failures map and discard as in ``transaction``."""
    try:
        async with engine.connect() as conn:
            try:
                yield conn
            except sa.exc.DBAPIError:
                await conn.invalidate()
                raise
    except (sa.exc.DBAPIError, sa.exc.TimeoutError, OSError, TimeoutError) as exc:
        raise StorageError() from exc


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One short transaction. Any database failure becomes StorageError, and the connection
    it happened on is discarded: after a failover or a restart the pool must not hand out a
    session that is read-only or half-dead."""
    try:
        async with engine.connect() as conn:
            try:
                # The engine autocommits (service/db.py); a write gets a real transaction.
                writing = await conn.execution_options(isolation_level="READ COMMITTED")
                async with writing.begin():
                    yield writing
            except sa.exc.DBAPIError:
                await conn.invalidate()
                raise
    except (sa.exc.DBAPIError, sa.exc.TimeoutError, OSError, TimeoutError) as exc:
        raise StorageError() from exc


_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError)


@asynccontextmanager
async def driver(engine: AsyncEngine, *, write: bool) -> AsyncIterator[asyncpg.Connection]:
    """The asyncpg connection under a pooled SQLAlchemy one, for the hot path's statements
    (compiled once by SQLAlchemy Core, see ``Compiled``): the same pool, pre-ping and failure
    mapping, without Core's per-execution work. ``write`` runs it in one transaction."""
    try:
        async with engine.connect() as conn:
            connection = (await conn.get_raw_connection()).driver_connection
            assert connection is not None  # a checked-out connection always has one
            try:
                if write:
                    async with connection.transaction():
                        yield connection
                else:
                    yield connection
            except (*_DRIVER_ERRORS, sa.exc.DBAPIError):
                await conn.invalidate()
                raise
    except (*_DRIVER_ERRORS, sa.exc.DBAPIError, sa.exc.TimeoutError, OSError, TimeoutError) as exc:
        raise StorageError() from exc


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
