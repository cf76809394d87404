"""Async Alembic environment: each migration in its own transaction with a bounded lock wait,
retried with backoff; concurrent runners serialised by an advisory lock, so `turnstore db
upgrade` is safe to start from many places while replicas serve (migrations/runner.py)."""

import asyncio
import functools
import os

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from migrations import runner
from service.platform.db import async_url
from service.platform.settings import Settings


def _refuse_unknown(connection: Connection, version_table: str) -> None:
    """A revision this release does not know was written by a newer one: say so in one line
    instead of Alembic's "Can't locate revision" traceback."""
    found: list[str] = []
    if connection.scalar(text("SELECT to_regclass(:t)::text"), {"t": version_table}):
        found = list(connection.scalars(text(f"SELECT version_num FROM {version_table}")))
    connection.commit()
    script = context.script
    known = {each.revision for each in script.walk_revisions()}
    unknown = [rev for rev in found if rev not in known]
    if unknown:
        raise RuntimeError(
            f"the database's {version_table} is at {', '.join(unknown)}, which this release "
            f"does not know (its newest is {script.get_current_head()}): a newer release "
            "migrated it; run that release's `turnstore db` instead"
        )


def _run(connection: Connection, lock_timeout_s: float, attempts: int) -> None:
    # The keyring's chain (migrations/keyring) keeps its version in a table of its own.
    version_table = context.config.attributes.get("version_table", "alembic_version")
    runner.prepare_session(connection)
    runner.take_lock(connection)
    try:
        # A read of the version table waits for its locks as a migration does (issue 28).
        refuse = functools.partial(_refuse_unknown, connection, version_table)
        runner.retried(connection, refuse, attempts, lock_timeout_s)
        context.configure(
            connection=connection, transaction_per_migration=True, version_table=version_table
        )
        heads = context.get_context().get_current_heads
        runner.run_with_retries(connection, context.run_migrations, heads, attempts, lock_timeout_s)
    finally:
        runner.release_lock(connection)


async def _main() -> None:
    attributes = context.config.attributes
    url = attributes.get("database_url") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL is not set")
    lock_timeout_s = attributes.get("lock_timeout_s")
    if lock_timeout_s is None:  # plain `alembic upgrade head`: from the environment
        lock_timeout_s = Settings.from_env().migration_lock_timeout_s
    attempts = attributes.get("attempts", runner.ATTEMPTS)
    engine = create_async_engine(
        async_url(url),
        poolclass=pool.NullPool,
        connect_args={"server_settings": runner.server_settings(lock_timeout_s)},
    )
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run, lock_timeout_s, attempts)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported")
asyncio.run(_main())
