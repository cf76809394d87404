"""PostgresStore's Idempotency-Keys (IdempotencyStore) and its operations (Operations):
purge, an owner's deletion, readiness and the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

from migrations.commit_function import digest
from service.core.errors import OwnerShredded, StorageError
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.ports import Readiness
from service.store.postgres import idempotency as idem
from service.store.postgres import run_statements
from service.store.postgres.adapter import Adapter
from service.store.postgres.sealed import writing_key
from service.store.postgres.tx import driver, in_use, sql, written

# What is left of an owner: their conversations, runs and Idempotency-Key records, and the
# rows that count their running turns and forks (OWNER_MAX_RUNNING_TURNS, ..._FORKS_...).
_OWNER_LEFT = sql(
    "SELECT (SELECT count(*) FROM conversations WHERE owner = :owner)"
    " + (SELECT count(*) FROM turn_runs WHERE owner = :owner)"
    " + (SELECT count(*) FROM idempotency_keys WHERE owner = :owner)"
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


class Housekeeping(Adapter):
    async def claim(self, key: IdempotencyKey, turn_id: UUID | None = None) -> Committed | None:
        data_key = await writing_key(self._keyring, key.owner)
        return await written(lambda: self._claim(key, turn_id, data_key))

    async def _claim(
        self, key: IdempotencyKey, turn_id: UUID | None, data_key: DataKey | None
    ) -> Committed | None:
        params = idem.key_params(key, data_key)
        now = datetime.now(UTC)
        until = now + timedelta(seconds=self._idempotency_lease_s)
        claim = {**params, "now": now, "until": until, "claimed_turn": turn_id}
        async with driver(self._engine, write=True) as conn:
            if await idem.CLAIM.fetchval(conn, claim) is not None:
                return None
            row = await idem.EXISTING.fetchrow(conn, params)  # locked by the claim: there
            if row is None:  # none made, none there: the owner was shredded
                raise OwnerShredded()
        return idem.answer(row, key, data_key)

    async def renew(self, keys: Sequence[IdempotencyKey], lease_s: float) -> None:
        until = datetime.now(UTC) + timedelta(seconds=lease_s)
        params = {
            "owners": [key.owner for key in keys], "keys": [key.key for key in keys],
            "claims": [key.claim for key in keys], "until": until,
        }  # fmt: skip
        async with driver(self._engine, write=False) as conn:  # one statement: autocommit
            await idem.RENEW.execute(conn, params)

    async def check(self, key: IdempotencyKey) -> None:
        async with driver(self._engine, write=False) as conn:
            row = await idem.LIVE.fetchrow(conn, idem.key_params(key))
        if row is not None:
            data_key = None if self._keyring is None else await self._keyring.for_read(key.owner)
            idem.answer(row, key, data_key)

    async def release(self, key: IdempotencyKey) -> None:
        async def release() -> None:
            async with driver(self._engine, write=False) as conn:  # one statement: autocommit
                await idem.RELEASE.execute(conn, idem.key_params(key))

        await written(release)

    async def release_run(self, turn_id: UUID, owner: str) -> None:
        async def release() -> None:
            async with driver(self._engine, write=False) as conn:  # one statement: autocommit
                await idem.RELEASE_RUN.execute(conn, {"owner": owner, "turn_id": turn_id})

        await written(release)

    async def purge(self, batch: int = 500) -> int:
        """Delete expired Idempotency-Key records, and conversations gone (idle past the
        retention, stored responses' past their expiry), a small batch per transaction so no
        lock is held long: a batch is picked, then deleted if still gone."""
        async with driver(self._engine, write=False) as conn:
            await idem.EXPIRED.execute(conn, {})
            await run_statements.EXPIRED.execute(conn, {})  # past TURN_EVENTS_TTL_S
        total = 0
        while True:
            async with driver(self._engine, write=False) as conn:
                picked = [
                    row["id"] for row in await self._sql.purge_pick.fetch(conn, {"batch": batch})
                ]
            if not picked:
                break
            async with driver(self._engine, write=True) as conn:
                gone = [row["id"] for row in await self._sql.purge.fetch(conn, {"ids": picked})]
                await run_statements.DELETE_OF.execute(conn, {"cids": gone})
            total += len(gone)
            if len(picked) < batch:
                break
        return total

    async def tombstone(self, owner: str) -> datetime:
        """Stop ``owner`` from committing anything, on every replica, from now on: their
        tombstone, named by a keyed digest. A moment after it was committed."""
        async with driver(self._engine, write=False) as conn:  # each statement: autocommit
            await _TOMBSTONE.execute(conn, {"owner": owner})
            made: datetime = await _NOW.fetchval(conn, {})
        return made

    async def writers_before(self, moment: datetime, wait_s: float) -> int:
        """Wait up to ``wait_s`` until no transaction that began before ``moment`` is open;
        how many still are. StorageError when this role cannot see other sessions' state."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            async with driver(self._engine, write=False) as conn:
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
        async with driver(self._engine, write=False) as conn:
            return bool(await self._sql.owner_sealed.fetchval(conn, {"owner": owner}))

    async def owner_rows(self, owner: str) -> int:
        """How many rows of ``owner`` are left (conversations, runs, Idempotency-Keys, the
        counts of their running turns and forks)."""
        async with driver(self._engine, write=False) as conn:
            return int(await _OWNER_LEFT.fetchval(conn, {"owner": owner}) or 0)

    async def delete_owner(self, owner: str, batch: int = 500) -> int:
        """Delete all of ``owner``'s conversations (with their turns, runs and events),
        Idempotency-Key records, the rows counting their running turns and forks and their
        revoked API keys, a batch per transaction; the number of conversations."""
        total, params = 0, {"owner": owner, "batch": batch}
        while True:
            async with driver(self._engine, write=True) as conn:
                gone = [row["id"] for row in await self._sql.owned.fetch(conn, params)]
                await run_statements.DELETE_OF.execute(conn, {"cids": gone})
            total += len(gone)
            if len(gone) < batch:
                break
        async with driver(self._engine, write=True) as conn:
            await run_statements.DELETE_OWNED.execute(conn, params)
            await idem.DELETE_OWNED.execute(conn, params)
            for counts in _OWNER_COUNTS:
                await counts.execute(conn, {"owner": owner})
        return total

    async def readiness(self) -> Readiness:
        async with driver(self._engine, write=False) as conn:
            state = (await self._sql.readiness.fetch(conn, {}))[0]  # always one row
            migrated = state["migrated"]
            version = await self._sql.schema_version.fetchval(conn, {}) if migrated else None
        if not state["writable"]:
            # Sessions opened while the database is read-only stay so: start afresh next time.
            await self._engine.dispose()
        keyring = self._keyring is None or await self._keyring.ready()
        return Readiness(None if version is None else str(version), state["writable"], keyring)

    def pool_in_use(self) -> int:
        return in_use(self._engine)

    async def close(self) -> None:
        await self._engine.dispose()
