"""The IdempotencyStore port in PostgreSQL: Idempotency-Key claims, held by a lease while their
write runs, released when it does not commit (the statements and what a record means:
idempotency.py; each write completes its own, Adapter.completed and statements.COMMIT). On
Citus a claim records the conversation its attempt writes, and one whose outcome is in doubt is
settled by its receipt there (receipts.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

from service.core.errors import OwnerShredded
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.postgres import idempotency as idem
from service.store.postgres import receipts
from service.store.postgres.adapter import Adapter
from service.store.postgres.sealed import writing_key
from service.store.postgres.tx import driver, grouped, written


class PostgresIdempotency:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def claim(self, key: IdempotencyKey, turn_id: UUID | None = None) -> Committed | None:
        data_key = await writing_key(self._db.keyring, key.owner)
        return await written(lambda: self._claim(key, turn_id, data_key))

    async def _claim(
        self, key: IdempotencyKey, turn_id: UUID | None, data_key: DataKey | None
    ) -> Committed | None:
        params = idem.key_params(key, data_key)
        now = datetime.now(UTC)
        until = now + timedelta(seconds=self._db.config.idempotency_lease_s)
        if await self._db.distributed():  # a claim in doubt is settled by its receipt
            clock = {"now": now, "until": until, "ttl_s": self._db.config.idempotency_ttl_s}
            return await receipts.claim(self._db, key, turn_id, data_key, clock)
        claim = {**params, "now": now, "until": until, "claimed_turn": turn_id}
        async with driver(self._db.engine, write=True) as conn:
            if await idem.CLAIM.fetchval(conn, claim) is not None:
                return None
            row = await idem.EXISTING.fetchrow(conn, params)  # locked by the claim: there
            if row is None:  # none made, none there: the owner was shredded
                raise OwnerShredded()
        return idem.answer(row, key, data_key)

    async def renew(self, keys: Sequence[IdempotencyKey], lease_s: float) -> None:
        until = datetime.now(UTC) + timedelta(seconds=lease_s)
        batches = [
            {
                "owners": [owner],
                "keys": [key.key for key in held],
                "claims": [key.claim for key in held],
                "until": until,
            }
            for owner, held in grouped((key.owner, key) for key in keys).items()
        ]
        await self._db.each_group(idem.RENEW, batches)

    async def check(self, key: IdempotencyKey) -> None:
        async with driver(self._db.engine, write=False) as conn:
            row = await idem.LIVE.fetchrow(conn, idem.key_params(key))
        if row is not None:
            data_key = (
                None if self._db.keyring is None else await self._db.keyring.for_read(key.owner)
            )
            idem.answer(row, key, data_key)

    async def release(self, key: IdempotencyKey, *, in_doubt: bool = True) -> None:
        async def release() -> None:
            statement = await receipts.releasing(self._db, in_doubt)
            async with driver(self._db.engine, write=False) as conn:  # one statement: autocommit
                await statement.execute(conn, idem.key_params(key))

        await written(release)

    async def release_run(self, turn_id: UUID, owner: str) -> None:
        async def release() -> None:
            async with driver(self._db.engine, write=False) as conn:  # one statement: autocommit
                await idem.RELEASE_RUN.execute(conn, {"owner": owner, "turn_id": turn_id})

        await written(release)
