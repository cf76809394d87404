"""The Operations port in PostgreSQL: what expired purged, readiness and the pool's gauge
(for operators and probes, not for the domain)."""

from __future__ import annotations

from service.store.ports import Readiness
from service.store.postgres import idempotency as idem
from service.store.postgres import receipts, run_homes
from service.store.postgres.adapter import Adapter
from service.store.postgres.tx import driver, in_use


class PostgresOperations:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def purge(self, batch: int = 500) -> int:
        """Delete expired Idempotency-Key records, and conversations gone (idle past the
        retention, stored responses' past their expiry), a small batch per transaction so no
        lock is held long: a batch is picked, then deleted if still gone."""
        engine, sql = self._db.engine, self._db.sql
        async with driver(engine, write=False) as conn:
            await idem.EXPIRED.execute(conn, {"ttl_s": self._db.config.idempotency_ttl_s})
            await receipts.delete_expired(self._db, conn)  # with their keys' TTL
            await run_homes.delete_expired(self._db, conn)  # past TURN_EVENTS_TTL_S
        total = 0
        while True:
            async with driver(engine, write=False) as conn:
                picked = [row["id"] for row in await sql.purge_pick.fetch(conn, {"batch": batch})]
            if not picked:
                break
            async with driver(engine, write=True) as conn:
                gone = [row["id"] for row in await sql.purge.fetch(conn, {"ids": picked})]
                await run_homes.delete_of(self._db, conn, gone)
                await receipts.delete_of(self._db, conn, gone)
            total += len(gone)
            if len(picked) < batch:
                break
        return total

    async def readiness(self) -> Readiness:
        async with driver(self._db.engine, write=False) as conn:
            state = (await self._db.sql.readiness.fetch(conn, {}))[0]  # always one row
            migrated = state["migrated"]
            version = await self._db.sql.schema_version.fetchval(conn, {}) if migrated else None
        if not state["writable"]:
            # Sessions opened while the database is read-only stay so: start afresh next time.
            await self._db.engine.dispose()
        keyring = self._db.keyring is None or await self._db.keyring.ready()
        return Readiness(None if version is None else str(version), state["writable"], keyring)

    def pool_in_use(self) -> int:
        return in_use(self._db.engine)
