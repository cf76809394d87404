"""Async Alembic environment. Migrations of concurrent runners are serialised by a
transaction-scoped advisory lock, so `turnstore db upgrade` is safe to start from many places."""

import asyncio
import os

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from service.platform.db import async_url

MIGRATION_LOCK_ID = 0x7475726E  # "turn"


def _run(connection: Connection) -> None:
    # The keyring's chain (migrations/keyring) keeps its version in a table of its own.
    version_table = context.config.attributes.get("version_table", "alembic_version")
    context.configure(
        connection=connection, transaction_per_migration=False, version_table=version_table
    )
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


async def _main() -> None:
    url = context.config.attributes.get("database_url") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL is not set")
    engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported")
asyncio.run(_main())
