"""What every part of PostgresStore shares: the engine, the statements compiled for its
retention, the keyring and the time limits it was made with."""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.model import ConversationInfo, IdempotencyKey
from service.store.postgres import idempotency as idem
from service.store.postgres.keyring import Keyring
from service.store.postgres.places import Places
from service.store.postgres.rows import reading
from service.store.postgres.statements import Statements


class Adapter:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        retention_days: float | None = None,
        idempotency_ttl_s: float = 86_400,
        idempotency_lease_s: float = 600,
        events_ttl_s: float = 600,
        stored_response_ttl_s: float = 30 * 86_400,
        keyring: Keyring | None = None,
        forks_per_minute: int | None = None,
        running_turns: int | None = None,
    ) -> None:
        self._engine = engine
        # With a keyring (ENCRYPTION_KEYS_FILE), what users said is written sealed.
        self._keyring = keyring
        self._sql = Statements(retention_days)
        self._retention = retention_days
        self._idempotency_ttl_s = idempotency_ttl_s
        self._events_ttl_s = events_ttl_s
        self._stored_response_ttl_s = stored_response_ttl_s
        # A claimed key whose replica died is taken over after this long.
        self._idempotency_lease_s = idempotency_lease_s
        self._forks_per_minute = forks_per_minute  # OWNER_MAX_FORKS_PER_MINUTE (None: any)
        self._places = Places(engine, running_turns)  # OWNER_MAX_RUNNING_TURNS (None: any)

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    @property
    def places(self) -> Places:
        return self._places

    @property
    def keyring(self) -> Keyring | None:
        return self._keyring

    async def _completed(
        self, conn: asyncpg.Connection, key: IdempotencyKey | None, cid: Any, revision: int | None
    ) -> None:
        """In a write's transaction: its Idempotency-Key, if it came with one, names what it
        did (the conversation it made or changed, the revision it left; a deletion: none)."""
        await idem.complete(conn, key, cid, revision, self._idempotency_ttl_s)

    async def _info_of(self, row: asyncpg.Record, owner: str) -> ConversationInfo:
        """A conversation read back (statements.INFO), its metadata opened if sealed."""
        codec = await reading(self._keyring, owner, row["id"], [row], ["metadata"])
        return codec.info(row)
