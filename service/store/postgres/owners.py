"""An owner shredded in PostgreSQL (`turnstore owners shred`, service/cli.py): their tombstone,
so that no replica commits anything of theirs from then on; the wait for their writes already
under way; then their rows, and what is left of them."""

from __future__ import annotations

import asyncio
from datetime import datetime

from migrations.commit_function import digest
from service.core.errors import StorageError
from service.store.postgres import idempotency as idem
from service.store.postgres import receipts, run_homes
from service.store.postgres.adapter import Adapter
from service.store.postgres.tx import driver, sql

# What is left of an owner: their conversations, runs (and their homes: run_homes.py) and
# Idempotency-Key records, and the rows that count their running turns and forks
# (OWNER_MAX_RUNNING_TURNS, ..._FORKS_...).
_OWNER_LEFT = sql(
    "SELECT (SELECT count(*) FROM conversations WHERE owner = :owner)"
    " + (SELECT count(*) FROM turn_runs WHERE owner = :owner)"
    " + (SELECT count(*) FROM run_homes WHERE owner = :owner)"
    " + (SELECT count(*) FROM idempotency_keys WHERE owner = :owner)"
    " + (SELECT count(*) FROM idempotency_receipts WHERE owner = :owner)"
    " + (SELECT count(*) FROM owner_turns WHERE owner = :owner)"
    " + (SELECT count(*) FROM owner_forks WHERE owner = :owner)"
    " + (SELECT count(*) FROM api_keys WHERE owner = :owner)"
)
# What names them besides their data: the rows counting their running turns and forks, and
# their API keys (revoked first, so that every replica refuses them; then gone).
_OWNER_COUNTS = (
    sql("DELETE FROM owner_turns WHERE owner = :owner"),
    sql("DELETE FROM owner_forks WHERE owner = :owner"),
    sql("DELETE FROM api_keys WHERE owner = :owner AND revoked_at IS NOT NULL"),
)
# The shred's tombstone (migration 0019): from its commit on, no write of the owner commits
# (the statements ask commit_function.shredded).
_TOMBSTONE = sql(f"""
    INSERT INTO owner_tombstones (digest, shredded_at)
    VALUES ({digest(":owner")}, clock_timestamp())
    ON CONFLICT (digest) DO NOTHING
""")
_NOW = sql("SELECT clock_timestamp()")
# The client sessions of this database in a transaction that began before :before (a write
# of the owner that began before the tombstone was committed may still commit until it ends),
# and those this role cannot see (their state is hidden without pg_read_all_stats).
_OLDER_WRITERS = sql("""
    SELECT count(*) FILTER (WHERE xact_start < CAST(:before AS timestamptz) AND state <> 'idle'),
        count(*) FILTER (WHERE state IS NULL)
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
        AND backend_type = 'client backend'
""")
WRITERS_POLL_S = 0.05


class PostgresOwners:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def tombstone(self, owner: str) -> datetime:
        """Stop ``owner`` from committing anything, on every replica, from now on: their
        tombstone, named by a keyed digest. A moment after it was committed."""
        async with driver(self._db.engine, write=False) as conn:  # each statement: autocommit
            await _TOMBSTONE.execute(conn, {"owner": owner})
            made: datetime = await _NOW.fetchval(conn, {})
        return made

    async def writers_before(self, moment: datetime, wait_s: float) -> int:
        """Wait up to ``wait_s`` until no transaction that began before ``moment`` is open;
        how many still are. StorageError when this role cannot see other sessions' state."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            async with driver(self._db.engine, write=False) as conn:
                row = await _OLDER_WRITERS.fetchrow(conn, {"before": moment})
            assert row is not None  # an aggregate answers one row
            if row[1]:
                raise StorageError(
                    "This role cannot see other sessions' transactions (grant it "
                    "pg_read_all_stats): whether a write of the owner is in flight is unknown."
                )
            if not row[0] or asyncio.get_running_loop().time() >= deadline:
                return int(row[0])
            await asyncio.sleep(WRITERS_POLL_S)

    async def owner_has_sealed_rows(self, owner: str) -> bool:
        async with driver(self._db.engine, write=False) as conn:
            return bool(await self._db.sql.owner_sealed.fetchval(conn, {"owner": owner}))

    async def owner_rows(self, owner: str) -> int:
        """How many rows of ``owner`` are left (conversations, runs, Idempotency-Keys, the
        counts of their running turns and forks)."""
        async with driver(self._db.engine, write=False) as conn:
            return int(await _OWNER_LEFT.fetchval(conn, {"owner": owner}) or 0)

    async def delete_owner(self, owner: str, batch: int = 500) -> int:
        """Delete all of ``owner``'s conversations (with their turns, runs and events),
        Idempotency-Key records, the rows counting their running turns and forks and their
        revoked API keys, a batch per transaction; the number of conversations."""
        total, params = 0, {"owner": owner, "batch": batch}
        while True:
            async with driver(self._db.engine, write=True) as conn:
                gone = [row["id"] for row in await self._db.sql.owned.fetch(conn, params)]
                await run_homes.delete_of(self._db, conn, gone)
                await receipts.delete_of(self._db, conn, gone)
            total += len(gone)
            if len(gone) < batch:
                break
        async with driver(self._db.engine, write=True) as conn:
            await run_homes.delete_owned(self._db, conn, owner)
            await receipts.delete_owned(self._db, conn, owner)
            await idem.DELETE_OWNED.execute(conn, params)
            for counts in _OWNER_COUNTS:
                await counts.execute(conn, {"owner": owner})
        return total
