"""``turnstore encrypt-existing``: rows written in clear, rewritten sealed, a batch at a time.

Each batch is one short transaction: rows in clear are read without a lock, then each is
sealed only if it is still as it was read (several runs may share the work: a row another run
sealed first is left alone). The plaintext is
exactly what the row held, so a replica's history cache stays valid and replay stays
byte-exact. Replicas must already run with ENCRYPTION_KEYS_FILE, or they would keep writing
in clear (and could not read what this rewrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.search import WORD
from service.store.postgres import terms
from service.store.postgres.keyring import Keyring
from service.store.postgres.sealed import (
    TURN_FIELDS,
    events_place,
    metadata_place,
    put,
    sealed_turn_columns,
)
from service.store.postgres.statements import SEARCH_PAIRS
from service.store.postgres.tx import Compiled, driver, sql

_CLEAR_TURNS = sql(
    "SELECT t.conversation_id, t.seq, t.user_message, t.assistant_message,"
    " CAST(t.replay_items AS text) AS replay_items, CAST(t.tool_calls AS text) AS tool_calls,"
    " CAST(t.transcript AS text) AS transcript, CAST(t.response AS text) AS response,"
    " CAST(t.compacted AS text) AS compacted,"
    " c.owner FROM turns t JOIN conversations c ON c.id = t.conversation_id"
    " WHERE t.sealed_replay_items IS NULL LIMIT :batch"
)
_SEAL_TURN = sql(
    "UPDATE turns SET "
    + ", ".join(f"{n} = :{n}, sealed_{n} = :sealed_{n}" for n in TURN_FIELDS)
    + " WHERE conversation_id = :conversation_id AND seq = :seq"
    + " AND sealed_replay_items IS NULL RETURNING 1"
)
_CLEAR_METADATA = sql(
    "SELECT id, owner, CAST(metadata AS text) AS metadata FROM conversations"
    " WHERE metadata IS NOT NULL AND sealed_metadata IS NULL"
    " LIMIT :batch"
)
_SEAL_METADATA = sql(
    "UPDATE conversations SET metadata = NULL, sealed_metadata = :sealed WHERE id = :id"
    " AND CAST(metadata AS text) = :metadata AND sealed_metadata IS NULL RETURNING 1"
)
_CLEAR_EVENTS = sql(
    "SELECT e.conversation_id, e.turn_id, e.seq, CAST(e.events AS text) AS events, r.owner"
    " FROM turn_events e JOIN turn_runs r"
    " ON r.conversation_id = e.conversation_id AND r.id = e.turn_id"
    " WHERE e.events IS NOT NULL LIMIT :batch"
)
_SEAL_EVENTS = sql(
    "UPDATE turn_events SET events = NULL, sealed_events = :sealed"
    " WHERE conversation_id = :conversation_id AND turn_id = :turn_id AND seq = :seq"
    " AND events IS NOT NULL RETURNING 1"
)
# Search terms in clear (migration 0021): the words PostgreSQL made (a lexeme not starting
# with "_") and the metadata pairs' unkeyed terms, replaced by keyed digests (terms.py).
_CLEAR_TERMS = "EXISTS (SELECT 1 FROM unnest(search) AS l WHERE left(l.lexeme, 1) <> '_')"
_CLEAR_SEARCH = sql(
    "SELECT id, owner,"
    " ARRAY(SELECT l.lexeme FROM unnest(search) AS l WHERE left(l.lexeme, 1) <> '_') AS words"
    f" FROM conversations WHERE {_CLEAR_TERMS} LIMIT :batch"
)
_SEAL_SEARCH = sql(
    "UPDATE conversations SET search = ts_delete(search, CAST(:words AS text[]))"
    " || array_to_tsvector(CAST(:digests AS text[])) WHERE id = :id RETURNING 1"
)
_PAIRS = sql(SEARCH_PAIRS)
_COUNT = sql(
    "SELECT (SELECT count(*) FROM turns WHERE sealed_replay_items IS NULL)"
    " + (SELECT count(*) FROM conversations"
    "    WHERE metadata IS NOT NULL AND sealed_metadata IS NULL)"
    " + (SELECT count(*) FROM turn_events WHERE events IS NOT NULL)"
    f" + (SELECT count(*) FROM conversations WHERE {_CLEAR_TERMS})"
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
        for step in (self._turns, self._metadata, self._events, self._search):
            async with driver(self.engine, write=True) as conn:
                done += await step(conn, batch)
        return done

    async def _turns(self, conn: asyncpg.Connection, batch: int) -> int:
        rows, done = await _CLEAR_TURNS.fetch(conn, {"batch": batch}), 0
        for row in rows:
            key = await self.keyring.for_write(row["owner"])
            cid, seq = row["conversation_id"], row["seq"]
            columns = sealed_turn_columns(key, cid, seq, row)
            done += len(
                await _SEAL_TURN.fetch(conn, {**columns, "conversation_id": cid, "seq": seq})
            )
        return done

    async def _metadata(self, conn: asyncpg.Connection, batch: int) -> int:
        """Each metadata sealed, and its pairs' search terms keyed with it."""
        done = 0
        for row in await _CLEAR_METADATA.fetch(conn, {"batch": batch}):
            where = metadata_place(row["id"])
            if await self._seal(conn, _SEAL_METADATA, row, where, row["metadata"]):
                key = await self.keyring.for_write(row["owner"])
                pairs = msgspec.json.decode(row["metadata"], type=dict[str, str]).items()
                keyed = {"cid": row["id"], "terms": terms.pair_terms(key, pairs)}
                await _PAIRS.execute(conn, keyed)
                done += 1
        return done

    async def _events(self, conn: asyncpg.Connection, batch: int) -> int:
        rows = await _CLEAR_EVENTS.fetch(conn, {"batch": batch})
        return sum(
            [
                await self._seal(
                    conn, _SEAL_EVENTS, row, events_place(row["turn_id"], row["seq"]), row["events"]
                )
                for row in rows
            ]
        )

    async def _search(self, conn: asyncpg.Connection, batch: int) -> int:
        """Each conversation's words in clear replaced by their keyed digests."""
        done = 0
        for row in await _CLEAR_SEARCH.fetch(conn, {"batch": batch}):
            key = await self.keyring.for_write(row["owner"])
            digests = [key.term(WORD, word) for word in row["words"]]
            done += len(
                await _SEAL_SEARCH.fetch(
                    conn, {"id": row["id"], "words": row["words"], "digests": digests}
                )
            )
        return done

    async def _seal(
        self, conn: asyncpg.Connection, statement: Compiled, row: Any, where: bytes, text: str
    ) -> int:
        """The row sealed, if it is still as it was read (rows are read without a lock: on
        Citus a FOR UPDATE over every shard is refused); 1 if it was."""
        key = await self.keyring.for_write(row["owner"])
        _, sealed = put(key, where, text)
        return len(await statement.fetch(conn, {**row, "sealed": sealed}))
