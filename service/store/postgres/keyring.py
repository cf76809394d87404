"""The keyring: each owner's data key, wrapped by a master key, in PostgreSQL.

A data key is made on its owner's first encrypted write and kept in memory for a minute
(unwrapped), so a turn costs the keyring nothing while its owner is active. Shredding replaces
the wrapped key by a tombstone: the key is gone, and no replica can make the owner a new one
(a write of theirs fails as if their conversation did not exist); other replicas drop their
copy of the old key within that minute (see the README). The keyring may live in a database
of its own (KEYRING_DATABASE_URL).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import ConversationNotFound, StorageError
from service.platform.crypto import DataKey, MasterKeys, new_data_key
from service.store.postgres.tx import driver, sql, written

CACHE_S = 60.0  # how long a replica keeps an unwrapped data key (at most twice that in memory)

_READ = sql("SELECT master_key_id, wrapped FROM owner_keys WHERE owner = :owner")
_CREATE = sql(
    "INSERT INTO owner_keys (owner, master_key_id, wrapped, created_at)"
    " VALUES (:owner, :key_id, :wrapped, now()) ON CONFLICT (owner) DO NOTHING"
)
SHREDDED = "-shredded-"  # a tombstone's master_key_id (no master key has this id)
_HELD = sql("SELECT master_key_id FROM owner_keys WHERE owner = :owner FOR UPDATE")
_TOMBSTONE = sql(
    "INSERT INTO owner_keys (owner, master_key_id, wrapped, created_at)"
    " VALUES (:owner, :shredded, :nothing, now()) ON CONFLICT (owner) DO UPDATE"
    " SET master_key_id = EXCLUDED.master_key_id, wrapped = EXCLUDED.wrapped"
)
_LIVE_KEYS = sql(
    "SELECT count(*) FROM owner_keys WHERE owner = :owner AND master_key_id <> :shredded"
)
_STALE = sql(
    "SELECT owner, master_key_id, wrapped FROM owner_keys WHERE master_key_id <> :current"
    " AND master_key_id <> :shredded ORDER BY owner LIMIT :batch"
)
_REWRAP = sql(
    "UPDATE owner_keys SET master_key_id = :key_id, wrapped = :wrapped"
    " WHERE owner = :owner AND master_key_id = :old"
)
_READY = sql("SELECT to_regclass('owner_keys') IS NOT NULL")
_COUNT_STALE = sql(
    "SELECT count(*) FROM owner_keys WHERE master_key_id <> :current AND master_key_id <> :shredded"
)


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
        """The owner's data key, made (and stored wrapped) if the owner has none yet; a
        shredded owner's is ConversationNotFound (nothing more is kept for them)."""
        key = await self._key(owner)
        while key is None:
            wrapped = self._masters.wrap(owner, new_data_key())
            await written(functools.partial(self._create, owner, *wrapped))
            key = await self._key(owner)  # ours, or a replica's that was first
        if isinstance(key, str):  # SHREDDED
            raise ConversationNotFound("The conversation's owner was shredded.")
        return key

    async def _create(self, owner: str, key_id: str, wrapped: bytes) -> None:
        async with driver(self._engine, write=False) as conn:  # one statement: autocommit
            await _CREATE.execute(conn, {"owner": owner, "key_id": key_id, "wrapped": wrapped})

    async def for_read(self, owner: str) -> DataKey | None:
        """The owner's data key; None if the owner has none (never encrypted, or shredded)."""
        key = await self._key(owner)
        return None if isinstance(key, str) else key

    async def _key(self, owner: str) -> DataKey | str | None:
        """The owner's data key, SHREDDED for a tombstone, None if there is no row."""
        now = self._clock()
        if now - self._swept_at > CACHE_S:  # expired keys leave memory, looked up again or not
            self._cache = {o: entry for o, entry in self._cache.items() if entry[0] > now}
            self._swept_at = now
        cached = self._cache.get(owner)
        if cached is not None and cached[0] > now:
            return cached[1]
        async with driver(self._engine, write=False) as conn:
            row = await _READ.fetchrow(conn, {"owner": owner})
        if row is None or row["master_key_id"] == SHREDDED:
            self._cache.pop(owner, None)
            return None if row is None else SHREDDED
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
            count = await _COUNT_STALE.fetchval(
                conn, {"current": self._masters.current, "shredded": SHREDDED}
            )
        return int(count or 0)

    async def rewrap(self, batch: int = 100) -> int:
        """Wrap up to ``batch`` data keys wrapped by an older master key with the first one;
        the number rewrapped (0: none is left). The data keys themselves do not change, so no
        stored value is rewritten and replicas keep working throughout."""
        current = self._masters.current
        async with driver(self._engine, write=False) as conn:
            rows = await _STALE.fetch(
                conn, {"current": current, "batch": batch, "shredded": SHREDDED}
            )
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
    """Replace the owner's data key in the keyring on ``engine`` by a tombstone, so that no
    replica makes them another; False if they had none. (No master key is needed.)"""
    async with driver(engine, write=True) as conn:
        held = await _HELD.fetchval(conn, {"owner": owner})
        await _TOMBSTONE.execute(conn, {"owner": owner, "shredded": SHREDDED, "nothing": b""})
    return held is not None and held != SHREDDED


async def live_keys(engine: AsyncEngine, owner: str) -> int:
    """How many data keys of ``owner`` the keyring on ``engine`` still holds (0 or 1)."""
    async with driver(engine, write=False) as conn:
        return int(await _LIVE_KEYS.fetchval(conn, {"owner": owner, "shredded": SHREDDED}) or 0)
