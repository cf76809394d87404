"""Where the tests' PostgreSQL comes from: TEST_DATABASE_URL, else a container when a
Docker engine answers, else the embedded server (so a fresh machine needs nothing)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yield the URL of a PostgreSQL server's maintenance database (superuser)."""
    if url := os.environ.get("TEST_DATABASE_URL"):
        yield url
        return
    try:
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver="asyncpg") as container:
            yield container.get_connection_url()
        return
    except Exception:  # no Docker engine: fails within milliseconds
        pass
    from service.platform.embedded import ensure_embedded_postgres

    server = ensure_embedded_postgres(REPO / ".turnstore")
    try:
        yield server.url
    finally:
        server.stop()


def asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[asyncpg.Connection]:
    """One asyncpg connection to the database at ``url`` (a SQLAlchemy URL too), closed after."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        yield conn
    finally:
        await conn.close()


def with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


async def admin(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@asynccontextmanager
async def read_only(server_url: str, database: str) -> AsyncIterator[None]:
    """The database ``database`` turns read-only and every session of it is cut (as a primary
    that became a standby); writable again on the way out."""
    await admin(
        server_url,
        f'ALTER DATABASE "{database}" SET default_transaction_read_only = on',
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE datname = '{database}' AND pid <> pg_backend_pid()",
    )
    try:
        yield
    finally:
        await admin(server_url, f'ALTER DATABASE "{database}" RESET default_transaction_read_only')


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server, dropped afterwards."""
    with _database(server_url, "") as url:
        yield url


@contextmanager
def copied_database(server_url: str, template_url: str) -> Iterator[str]:
    """A new database on the server, a copy of the database at ``template_url`` (which no one
    may be connected to), dropped afterwards: a migrated database without migrating."""
    template = make_url(template_url).database
    with _database(server_url, f' TEMPLATE "{template}"') as url:
        yield url


@contextmanager
def _database(server_url: str, options: str) -> Iterator[str]:
    name = f"turnstore_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(admin(server_url, f'CREATE DATABASE "{name}"{options}'))
    try:
        yield with_database(server_url, name)
    finally:
        asyncio.run(admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
