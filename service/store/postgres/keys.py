"""API keys (AUTH_MODE=api_key): ``ts_`` + 43 random URL-safe characters, of which only the
SHA-256 is stored. Every request looks its key up (no cache), so a revocation holds on every
replica from that replica's next request on."""

from __future__ import annotations

import re
import secrets

from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.model import ANONYMOUS, KEY_ID_CHARS, is_owner_name, key_hash
from service.store.postgres.tx import Compiled, Params, driver, sql

PREFIX = "ts_"
_SHAPE = re.compile(r"ts_[A-Za-z0-9_-]{43}")  # token_urlsafe(32): 32 bytes, 43 characters

_LOOKUP = sql("SELECT owner FROM api_keys WHERE key_hash = :hash AND revoked_at IS NULL")
_CREATE = sql("INSERT INTO api_keys (key_hash, owner) VALUES (:hash, :owner)")
# Revoking twice keeps the first revocation's time.
_REVOKE = """
    UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
    WHERE {which}
    RETURNING key_hash
"""
_REVOKE_KEY = sql(_REVOKE.format(which="key_hash = :hash"))
_REVOKE_ID = sql(_REVOKE.format(which=f"left(key_hash, {KEY_ID_CHARS}) = :key_id"))
_REVOKE_OWNED = sql(_REVOKE.format(which="owner = :owner"))


class ApiKeyStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def owner_of(self, key: str) -> str | None:
        """The owner of a live key; None for anything else (unknown, revoked, not a key)."""
        if not _SHAPE.fullmatch(key):
            return None  # the shape of a key is public: no query for garbage
        async with driver(self._engine, write=False) as conn:  # one statement: one round trip
            owner = await _LOOKUP.fetchval(conn, {"hash": key_hash(key)})
        return owner if is_owner_name(owner) else None  # never the reserved anonymous owner

    async def create(self, owner: str) -> str:
        """A new key for ``owner``: returned once, never stored."""
        if not is_owner_name(owner):
            raise ValueError(
                "the owner must be 1-256 characters, without control characters or surrounding "
                f"spaces, and not {ANONYMOUS!r} (reserved for AUTH_MODE=none)"
            )
        key = PREFIX + secrets.token_urlsafe(32)
        async with driver(self._engine, write=True) as conn:
            await _CREATE.execute(conn, {"hash": key_hash(key), "owner": owner})
        return key

    async def revoke(
        self, *, key: str | None = None, key_id: str | None = None, owner: str | None = None
    ) -> list[str]:
        """Revoke one key (given itself or by its id) or every key of ``owner``; the ids of
        the keys revoked (none: no such key)."""
        statement: Compiled
        params: Params
        if key is not None:
            statement, params = _REVOKE_KEY, {"hash": key_hash(key)}
        elif key_id is not None:
            statement, params = _REVOKE_ID, {"key_id": key_id.lower()}
        else:
            statement, params = _REVOKE_OWNED, {"owner": owner}
        async with driver(self._engine, write=True) as conn:
            rows = await statement.fetch(conn, params)
        return sorted(row["key_hash"][:KEY_ID_CHARS] for row in rows)
