"""Short transactions with one failure mapping, shared by the PostgreSQL adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
