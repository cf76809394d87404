"""The deployment's own random keys (migration 0019, ``turnstore_secrets``), read once per
process: every replica of a deployment reads the same ones.

``ids`` keys the ids turnstore mints; ``owners`` keys the digest a shredded owner's tombstone
names them by (never in clear).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import NotMigrated
from service.store.postgres.tx import driver, sql

_READ = sql("SELECT name, secret FROM turnstore_secrets")


@dataclass(frozen=True)
class Secrets:
    ids: bytes
    owners: bytes

    def owner_digest(self, owner: str) -> bytes:
        """What a tombstone names ``owner`` by: the statements compute the same in SQL
        (``sha256(owners secret || owner)``)."""
        return hashlib.sha256(self.owners + owner.encode()).digest()


class SecretsReader:
    """The secrets of ``engine``'s database, read on first use and kept."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._secrets: Secrets | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Secrets:
        if self._secrets is not None:
            return self._secrets
        async with self._lock:
            if self._secrets is None:
                async with driver(self._engine, write=False) as conn:
                    rows = await _READ.fetch(conn, {})
                found = {row["name"]: bytes(row["secret"]) for row in rows}
                if "ids" not in found or "owners" not in found:
                    raise NotMigrated()  # its rows are made by a migration
                self._secrets = Secrets(found["ids"], found["owners"])
        return self._secrets
