"""The keyring: each owner's data key, wrapped by a master key, in PostgreSQL.

A data key is made on its owner's first encrypted write and kept in memory for a minute
(unwrapped), so a turn costs the keyring nothing while its owner is active. Shredding deletes
the wrapped key; other replicas drop their copy within that minute (see the README). The
keyring may live in a database of its own (KEYRING_DATABASE_URL).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import StorageError
from service.platform.crypto import DataKey, MasterKeys, new_data_key
from service.store.postgres.tx import driver, sql, written

CACHE_S = 60.0  # how long a replica keeps an unwrapped data key (at most twice that in memory)

_READ = sql("SELECT master_key_id, wrapped FROM owner_keys WHERE owner = :owner")
_CREATE = sql(
    "INSERT INTO owner_keys (owner, master_key_id, wrapped, created_at)"
    " VALUES (:owner, :key_id, :wrapped, now()) ON CONFLICT (owner) DO NOTHING"
)
_SHRED = sql("DELETE FROM owner_keys WHERE owner = :owner RETURNING owner")
_STALE = sql(
    "SELECT owner, master_key_id, wrapped FROM owner_keys WHERE master_key_id <> :current"
    " ORDER BY owner LIMIT :batch"
)
_REWRAP = sql(
    "UPDATE owner_keys SET master_key_id = :key_id, wrapped = :wrapped"
    " WHERE owner = :owner AND master_key_id = :old"
)
_READY = sql("SELECT to_regclass('owner_keys') IS NOT NULL")
_COUNT_STALE = sql("SELECT count(*) FROM owner_keys WHERE master_key_id <> :current")


class Keyring:
    """Owners' data keys over one engine (the data's, or the keyring's own)."""

    def __init__(
        self,
        engine: AsyncEngine,
        masters: MasterKeys,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._masters = masters
        self._clock = clock
        self._cache: dict[str, tuple[float, DataKey]] = {}
        self._swept_at = clock()

    async def for_write(self, owner: str) -> DataKey:
        """The owner's data key, made (and stored wrapped) if the owner has none yet."""
        key = await self.for_read(owner)
        while key is None:  # (a shred between the two statements: make another)
            wrapped = self._masters.wrap(owner, new_data_key())
            await written(functools.partial(self._create, owner, *wrapped))
            key = await self.for_read(owner)  # ours, or a replica's that was first
        return key

    async def _create(self, owner: str, key_id: str, wrapped: bytes) -> None:
        async with driver(self._engine, write=False) as conn:  # one statement: autocommit
            await _CREATE.execute(conn, {"owner": owner, "key_id": key_id, "wrapped": wrapped})

    async def for_read(self, owner: str) -> DataKey | None:
        """The owner's data key; None if the owner has none (never encrypted, or shredded)."""
        now = self._clock()
        if now - self._swept_at > CACHE_S:  # expired keys leave memory, looked up again or not
            self._cache = {o: entry for o, entry in self._cache.items() if entry[0] > now}
            self._swept_at = now
        cached = self._cache.get(owner)
        if cached is not None and cached[0] > now:
            return cached[1]
        async with driver(self._engine, write=False) as conn:
            row = await _READ.fetchrow(conn, {"owner": owner})
        if row is None:
            self._cache.pop(owner, None)
            return None
        key = DataKey(self._masters.unwrap(owner, row["master_key_id"], row["wrapped"]))
        self._cache[owner] = (self._clock() + CACHE_S, key)
        return key

    async def ready(self) -> bool:
        """Whether the keyring's database answers and has its table."""
        try:
            async with driver(self._engine, write=False) as conn:
                return bool(await _READY.fetchval(conn, {}))
        except StorageError:
            return False

    async def stale(self) -> int:
        """How many data keys are wrapped by a master key other than the first."""
        async with driver(self._engine, write=False) as conn:
            count = await _COUNT_STALE.fetchval(conn, {"current": self._masters.current})
        return int(count or 0)

    async def rewrap(self, batch: int = 100) -> int:
        """Wrap up to ``batch`` data keys wrapped by an older master key with the first one;
        the number rewrapped (0: none is left). The data keys themselves do not change, so no
        stored value is rewritten and replicas keep working throughout."""
        current = self._masters.current
        async with driver(self._engine, write=False) as conn:
            rows = await _STALE.fetch(conn, {"current": current, "batch": batch})
            for row in rows:
                owner, old = row["owner"], row["master_key_id"]
                key_id, wrapped = self._masters.wrap(
                    owner, self._masters.unwrap(owner, old, row["wrapped"])
                )
                await _REWRAP.execute(
                    conn, {"owner": owner, "key_id": key_id, "wrapped": wrapped, "old": old}
                )
        return len(rows)


async def destroy_key(engine: AsyncEngine, owner: str) -> bool:
    """Delete the owner's data key from the keyring on ``engine``; False if there was none.
    (No master key is needed to destroy one.)"""
    async with driver(engine, write=False) as conn:
        return await _SHRED.fetchrow(conn, {"owner": owner}) is not None
