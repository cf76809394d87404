"""API keys (AUTH_MODE=api_key): ``ts_`` + 43 random URL-safe characters, of which only the
SHA-256 is stored. Every request looks its key up (no cache), so a revocation holds on every
replica from that replica's next request on."""

from __future__ import annotations

import hashlib
import re
import secrets

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.tables import api_keys
from service.store.tx import read, transaction

PREFIX = "ts_"
_SHAPE = re.compile(r"ts_[A-Za-z0-9_-]{43}")  # token_urlsafe(32): 32 bytes, 43 characters
_OWNER = re.compile(r"[^\x00-\x1f\x7f]{1,256}")

_LOOKUP = sa.select(api_keys.c.owner).where(
    api_keys.c.key_hash == sa.bindparam("h"), api_keys.c.revoked_at.is_(None)
)
_REVOKE = (
    sa.update(api_keys)
    .where(api_keys.c.key_hash == sa.bindparam("h"))
    # Revoking twice keeps the first revocation's time.
    .values(revoked_at=sa.func.coalesce(api_keys.c.revoked_at, sa.func.now()))
    .returning(api_keys.c.owner)
)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def owner_of(self, key: str) -> str | None:
        """The owner of a live key; None for anything else (unknown, revoked, not a key)."""
        if not _SHAPE.fullmatch(key):
            return None  # the shape of a key is public: no query for garbage
        async with read(self._engine) as conn:  # one statement, autocommit: one round trip
            owner = await conn.scalar(_LOOKUP, {"h": key_hash(key)})
        return None if owner is None else str(owner)

    async def create(self, owner: str) -> str:
        """A new key for ``owner``: returned once, never stored."""
        if not _OWNER.fullmatch(owner) or owner != owner.strip():
            raise ValueError("the owner must be 1-256 characters, without control characters")
        key = PREFIX + secrets.token_urlsafe(32)
        async with transaction(self._engine) as conn:
            await conn.execute(sa.insert(api_keys).values(key_hash=key_hash(key), owner=owner))
        return key

    async def revoke(self, key: str) -> bool:
        """Revoke ``key``; False when no such key was ever created."""
        async with transaction(self._engine) as conn:
            owner = await conn.scalar(_REVOKE, {"h": key_hash(key)})
        return owner is not None
