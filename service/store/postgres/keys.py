"""API keys (AUTH_MODE=api_key): ``ts_`` + 43 random URL-safe characters, of which only the
SHA-256 is stored. Every request looks its key up (no cache), so a revocation holds on every
replica from that replica's next request on."""

from __future__ import annotations

import re
import secrets

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.model import ANONYMOUS, KEY_ID_CHARS, is_owner_name, key_hash
from service.store.postgres.tables import api_keys
from service.store.postgres.tx import read, transaction

PREFIX = "ts_"
_SHAPE = re.compile(r"ts_[A-Za-z0-9_-]{43}")  # token_urlsafe(32): 32 bytes, 43 characters

_LOOKUP = sa.select(api_keys.c.owner).where(
    api_keys.c.key_hash == sa.bindparam("h"), api_keys.c.revoked_at.is_(None)
)
# Revoking twice keeps the first revocation's time.
_REVOKE = (
    sa.update(api_keys)
    .values(revoked_at=sa.func.coalesce(api_keys.c.revoked_at, sa.func.now()))
    .returning(api_keys.c.key_hash)
)


class ApiKeyStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def owner_of(self, key: str) -> str | None:
        """The owner of a live key; None for anything else (unknown, revoked, not a key)."""
        if not _SHAPE.fullmatch(key):
            return None  # the shape of a key is public: no query for garbage
        async with read(self._engine) as conn:  # one statement, autocommit: one round trip
            owner = await conn.scalar(_LOOKUP, {"h": key_hash(key)})
        return owner if is_owner_name(owner) else None  # never the reserved anonymous owner

    async def create(self, owner: str) -> str:
        """A new key for ``owner``: returned once, never stored."""
        if not is_owner_name(owner):
            raise ValueError(
                "the owner must be 1-256 characters, without control characters or surrounding "
                f"spaces, and not {ANONYMOUS!r} (reserved for AUTH_MODE=none)"
            )
        key = PREFIX + secrets.token_urlsafe(32)
        async with transaction(self._engine) as conn:
            await conn.execute(sa.insert(api_keys).values(key_hash=key_hash(key), owner=owner))
        return key

    async def revoke(
        self, *, key: str | None = None, key_id: str | None = None, owner: str | None = None
    ) -> list[str]:
        """Revoke one key (given itself or by its id) or every key of ``owner``; the ids of
        the keys revoked (none: no such key)."""
        if key is not None:
            where = api_keys.c.key_hash == key_hash(key)
        elif key_id is not None:
            where = sa.func.left(api_keys.c.key_hash, KEY_ID_CHARS) == key_id.lower()
        else:
            where = api_keys.c.owner == owner
        async with transaction(self._engine) as conn:
            hashes = (await conn.scalars(_REVOKE.where(where))).all()
        return sorted(h[:KEY_ID_CHARS] for h in hashes)
