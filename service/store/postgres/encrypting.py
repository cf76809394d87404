"""``turnstore encrypt-existing``: rows written in clear, rewritten sealed, a batch at a time.

Each batch is one short transaction that locks only its own rows (``SKIP LOCKED``: several
runs share the work, and a turn being committed is never waited for). The plaintext is
exactly what the row held, so a replica's history cache stays valid and replay stays
byte-exact. Replicas must already run with ENCRYPTION_KEYS_FILE, or they would keep writing
in clear (and could not read what this rewrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.postgres.keyring import Keyring
from service.store.postgres.sealed import (
    TURN_FIELDS,
    events_place,
    metadata_place,
    put,
    sealed_turn_columns,
)
from service.store.postgres.tx import Compiled, driver, sql

_CLEAR_TURNS = sql(
    "SELECT t.conversation_id, t.seq, t.user_message, t.assistant_message,"
    " CAST(t.replay_items AS text) AS replay_items, CAST(t.tool_calls AS text) AS tool_calls,"
    " CAST(t.transcript AS text) AS transcript, CAST(t.response AS text) AS response,"
    " CAST(t.compacted AS text) AS compacted,"
    " c.owner FROM turns t JOIN conversations c ON c.id = t.conversation_id"
    " WHERE t.sealed_replay_items IS NULL LIMIT :batch FOR UPDATE OF t SKIP LOCKED"
)
_SEAL_TURN = sql(
    "UPDATE turns SET " + ", ".join(f"{n} = :{n}, sealed_{n} = :sealed_{n}" for n in TURN_FIELDS)
    + " WHERE conversation_id = :conversation_id AND seq = :seq"
)  # fmt: skip
_CLEAR_METADATA = sql(
    "SELECT id, owner, CAST(metadata AS text) AS metadata FROM conversations"
    " WHERE metadata IS NOT NULL AND sealed_metadata IS NULL"
    " LIMIT :batch FOR NO KEY UPDATE SKIP LOCKED"
)
_SEAL_METADATA = sql(
    "UPDATE conversations SET metadata = NULL, sealed_metadata = :sealed WHERE id = :id"
)
_CLEAR_EVENTS = sql(
    "SELECT e.turn_id, e.seq, CAST(e.events AS text) AS events, r.owner"
    " FROM turn_events e JOIN turn_runs r ON r.id = e.turn_id"
    " WHERE e.events IS NOT NULL LIMIT :batch FOR UPDATE OF e SKIP LOCKED"
)
_SEAL_EVENTS = sql(
    "UPDATE turn_events SET events = NULL, sealed_events = :sealed"
    " WHERE turn_id = :turn_id AND seq = :seq"
)
_COUNT = sql(
    "SELECT (SELECT count(*) FROM turns WHERE sealed_replay_items IS NULL)"
    " + (SELECT count(*) FROM conversations"
    "    WHERE metadata IS NOT NULL AND sealed_metadata IS NULL)"
    " + (SELECT count(*) FROM turn_events WHERE events IS NOT NULL)"
)


@dataclass
class ClearRows:
    """The rows still in clear, and how to seal them."""

    engine: AsyncEngine
    keyring: Keyring

    async def count(self) -> int:
        async with driver(self.engine, write=False) as conn:
            return int(await _COUNT.fetchval(conn, {}) or 0)

    async def encrypt_batch(self, batch: int) -> int:
        """Seal up to ``batch`` rows of each kind; how many were sealed (0: none is left
        that is not locked by someone else)."""
        done = 0
        for step in (self._turns, self._metadata, self._events):
            async with driver(self.engine, write=True) as conn:
                done += await step(conn, batch)
        return done

    async def _turns(self, conn: asyncpg.Connection, batch: int) -> int:
        rows = await _CLEAR_TURNS.fetch(conn, {"batch": batch})
        for row in rows:
            key = await self.keyring.for_write(row["owner"])
            cid, seq = row["conversation_id"], row["seq"]
            columns = sealed_turn_columns(key, cid, seq, row)
            await _SEAL_TURN.execute(conn, {**columns, "conversation_id": cid, "seq": seq})
        return len(rows)

    async def _metadata(self, conn: asyncpg.Connection, batch: int) -> int:
        rows = await _CLEAR_METADATA.fetch(conn, {"batch": batch})
        for row in rows:
            where = metadata_place(row["id"])
            await self._seal(conn, _SEAL_METADATA, row, where, row["metadata"])
        return len(rows)

    async def _events(self, conn: asyncpg.Connection, batch: int) -> int:
        rows = await _CLEAR_EVENTS.fetch(conn, {"batch": batch})
        for row in rows:
            where = events_place(row["turn_id"], row["seq"])
            await self._seal(conn, _SEAL_EVENTS, row, where, row["events"])
        return len(rows)

    async def _seal(
        self, conn: asyncpg.Connection, statement: Compiled, row: Any, where: bytes, text: str
    ) -> None:
        key = await self.keyring.for_write(row["owner"])
        _, sealed = put(key, where, text)
        await statement.execute(conn, {**row, "sealed": sealed})
