"""The keyring: each owner's data key, wrapped by a master key, in PostgreSQL.

A data key is made on its owner's first encrypted write and kept in memory for a minute
(unwrapped), so a turn costs the keyring nothing while its owner is active. Shredding replaces
the owner's key by a tombstone named by a keyed digest of the owner (``tombstone_name``, the
deployment's ``owners`` secret: never the owner in clear): the key is gone, and no replica can
make the owner a new one (a write of theirs fails as if their conversation did not exist);
other replicas drop their copy of the old key within that minute (see the README). The keyring
may live in a database of its own (KEYRING_DATABASE_URL).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import OwnerShredded, StorageError
from service.platform.crypto import DataKey, MasterKeys, new_data_key
from service.store.postgres.secrets import SecretsReader
from service.store.postgres.tx import driver, sql, written

CACHE_S = 60.0  # how long a replica keeps an unwrapped data key (at most twice that in memory)

SHREDDED = "-shredded-"  # a tombstone's master_key_id (no master key has this id)
# The owner's row, and their tombstone's (a tombstone made before 0019 named them in clear).
_READ = sql(
    "SELECT owner, master_key_id, wrapped FROM owner_keys WHERE owner = :owner OR owner = :tomb"
)
_CREATE = sql(
    "INSERT INTO owner_keys (owner, master_key_id, wrapped, created_at)"
    " SELECT :owner, :key_id, :wrapped, now()"
    " WHERE NOT EXISTS (SELECT 1 FROM owner_keys WHERE owner = :tomb)"
    " ON CONFLICT (owner) DO NOTHING"
)
_HELD = sql("SELECT master_key_id FROM owner_keys WHERE owner = :owner FOR UPDATE")
_FORGET = sql("DELETE FROM owner_keys WHERE owner = :owner")
_TOMBSTONE = sql(
    "INSERT INTO owner_keys (owner, master_key_id, wrapped, created_at)"
    " VALUES (:tomb, :shredded, :nothing, now()) ON CONFLICT (owner) DO NOTHING"
)
# Every row naming the owner in clear: a live key, or a tombstone made before 0019.
_NAMED = sql("SELECT count(*) FROM owner_keys WHERE owner = :owner")
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

Digest = Callable[[str], Awaitable[bytes]]  # an owner's keyed digest (store/postgres/secrets.py)


def owner_digests(engine: AsyncEngine) -> Digest:
    """Owners' digests by the secrets of the data's database on ``engine``."""
    secrets = SecretsReader(engine)

    async def digest(owner: str) -> bytes:
        return (await secrets.get()).owner_digest(owner)

    return digest


def tombstone_name(digest: bytes) -> str:
    """What an owner's tombstone is named by in the keyring (its key column)."""
    return "shredded:" + digest.hex()


class Keyring:
    """Owners' data keys over one engine (the data's, or the keyring's own)."""

    def __init__(
        self,
        engine: AsyncEngine,
        masters: MasterKeys,
        digest: Digest | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``digest``: how owners are digested for their tombstones (default: by the secrets
        of ``engine``'s database, where the keyring lives beside the data)."""
        self._engine = engine
        self._masters = masters
        self._digest = digest or owner_digests(engine)
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
            raise OwnerShredded()
        return key

    async def _create(self, owner: str, key_id: str, wrapped: bytes) -> None:
        tomb = tombstone_name(await self._digest(owner))
        params = {"owner": owner, "key_id": key_id, "wrapped": wrapped, "tomb": tomb}
        async with driver(self._engine, write=False) as conn:  # one statement: autocommit
            await _CREATE.execute(conn, params)
        # A tombstone made meanwhile: no key, and the next look says so.

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
        tomb = tombstone_name(await self._digest(owner))
        async with driver(self._engine, write=False) as conn:
            rows = await _READ.fetch(conn, {"owner": owner, "tomb": tomb})
        if not rows or any(row["master_key_id"] == SHREDDED for row in rows):
            self._cache.pop(owner, None)
            return None if not rows else SHREDDED
        [row] = rows
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


async def destroy_key(engine: AsyncEngine, owner: str, digest: bytes) -> bool:
    """Replace the owner's data key in the keyring on ``engine`` by a tombstone named by their
    ``digest`` (never their name), so that no replica makes them another; False if they had
    none. (No master key is needed.)"""
    async with driver(engine, write=True) as conn:
        held = await _HELD.fetchval(conn, {"owner": owner})
        await _FORGET.execute(conn, {"owner": owner})
        await _TOMBSTONE.execute(
            conn, {"tomb": tombstone_name(digest), "shredded": SHREDDED, "nothing": b""}
        )
    return held is not None and held != SHREDDED


async def live_keys(engine: AsyncEngine, owner: str) -> int:
    """How many rows of the keyring on ``engine`` still name ``owner`` (a data key, or a
    tombstone naming them in clear): 0 once shredded."""
    async with driver(engine, write=False) as conn:
        return int(await _NAMED.fetchval(conn, {"owner": owner}) or 0)
