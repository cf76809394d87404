"""The Places port in PostgreSQL: what a running turn holds besides what it reads. Its lease on
its conversation (taken with its window read, History.lease; released by its commit or here;
renewed here), its place among its owner's running turns (running_turns.py) and its fork's place
among its owner's forks of the minute (forks.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

from service.store.postgres import forks, running_turns
from service.store.postgres.adapter import Adapter
from service.store.postgres.tx import driver, grouped, written


async def release(db: Adapter, conversation_id: UUID, holder: UUID) -> None:
    """The lease given up, if ``holder`` holds it; turns queued for it are woken."""

    async def release() -> bool:
        async with driver(db.engine, write=False) as conn:
            params = {"cid": conversation_id, "holder": holder}
            return bool(await db.sql.release_lease.fetchval(conn, params))

    if await written(release):  # turns wait for it
        await db.wake([f"lease:{conversation_id}"])


class PostgresPlaces:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        await release(self._db, conversation_id, holder)

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        until = datetime.now(UTC) + timedelta(seconds=lease_s)
        batches = [
            {"cids": [cid], "holders": holders, "until": until}
            for cid, holders in grouped(leases).items()
        ]  # each conversation's on its worker
        return {row["id"] for row in await self._db.each_group(self._db.sql.renew_leases, batches)}

    async def take_turn(self, owner: str, holder: UUID, lease_s: float) -> bool:
        return await self._db.places.take(owner, holder, lease_s)

    async def free_turn(self, owner: str, holder: UUID) -> None:
        await self._db.places.free(owner, holder)

    async def renew_turns(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> None:
        places = self._db.places
        await self._db.each_group(running_turns.RENEW, places.renewals(turns, lease_s))

    async def take_fork(self, owner: str, conversation_id: UUID) -> None:
        most = self._db.config.forks_per_minute
        if most is None:
            return
        fork = {"caller": owner, "new": conversation_id}

        async def take() -> None:
            async with driver(self._db.engine, write=True) as conn:
                await forks.take_slot(self._db, conn, fork, most)

        await written(take)

    async def free_fork(self, owner: str, conversation_id: UUID) -> None:
        if self._db.config.forks_per_minute is None:
            return
        async with driver(self._db.engine, write=False) as conn:
            await self._db.sql.free_fork.execute(conn, {"caller": owner, "new": conversation_id})
