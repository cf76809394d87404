"""The one PostgreSQL server of a bench run and the fresh database it works in.

BENCH_DATABASE_URL (a superuser URL of a server's maintenance database) if set, else an
embedded server of the bench's own under .turnstore/bench (so a test run sharing the
project's embedded server can never stop it halfway)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url

from service.platform import migrate

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def server() -> Iterator[str]:
    if url := os.environ.get("BENCH_DATABASE_URL"):
        yield url
        return
    from service.platform.embedded import ensure_embedded_postgres

    root = REPO / ".turnstore" / "bench"
    embedded = ensure_embedded_postgres(root)
    if embedded.started_here and not asyncio.run(_preloaded(embedded.url)):
        # pg_stat_statements counts the statements of a turn (bench/dbwork.py): it must be
        # loaded at start, so the bench's own server is restarted once with it.
        asyncio.run(admin(embedded.url, _PRELOAD))
        embedded.stop()
        embedded = ensure_embedded_postgres(root)
    try:
        yield embedded.url
    finally:
        embedded.stop()


_PRELOAD = "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"


async def _preloaded(url: str) -> bool:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        return "pg_stat_statements" in str(await conn.fetchval("SHOW shared_preload_libraries"))
    finally:
        await conn.close()


def sqlalchemy_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False)


def libpq_url(url: str) -> str:
    """For asyncpg and psycopg."""
    return make_url(url).set(drivername="postgresql").render_as_string(False)


async def admin(url: str, statement: str) -> None:
    """One statement on its own connection (database and function definitions)."""
    conn = await asyncpg.connect(libpq_url(url))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new database migrated to turnstore's head, dropped afterwards."""
    name = f"turnstore_bench_{uuid.uuid4().hex[:12]}"
    asyncio.run(admin(server_url, f'CREATE DATABASE "{name}"'))
    url = make_url(server_url).set(database=name).render_as_string(False)
    try:
        migrate.upgrade(sqlalchemy_url(url))
        with contextlib.suppress(asyncpg.PostgresError):  # counted where the server has it
            asyncio.run(admin(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        yield url
    finally:
        asyncio.run(admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def relation_bytes(url: str, tables: tuple[str, ...]) -> int:
    """Heap, TOAST and indexes of ``tables`` (pg_total_relation_size)."""
    conn = await asyncpg.connect(libpq_url(url))
    try:
        size = await conn.fetchval(
            "SELECT coalesce(sum(pg_total_relation_size(to_regclass(name))), 0)::bigint"
            " FROM unnest($1::text[]) AS name",
            list(tables),
        )
        return int(size)
    finally:
        await conn.close()


async def settle(url: str) -> None:
    """Flush what earlier work left dirty, so it does not slow down the next measurement
    (without it the first turns after a throughput run are measurably slower, for every
    subject). Needs superuser or pg_checkpoint; skipped without."""
    conn = await asyncpg.connect(libpq_url(url))
    try:
        await conn.execute("CHECKPOINT")
    except asyncpg.InsufficientPrivilegeError:
        pass
    finally:
        await conn.close()
    await asyncio.sleep(0.5)


async def server_version(url: str) -> str:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()
