"""The plain-asyncpg baseline: a range SELECT of the history, then one transaction with a
conditional UPDATE of the conversation's revision and a multi-row INSERT of the turn's
replay items (one row each; the user and assistant rows also carry the transcript text).
Two pool checkouts per turn, like turnstore: no connection is held between read and write."""

from __future__ import annotations

from uuid import UUID

import asyncpg

from bench.database import libpq_url
from bench.workload import Payload

SCHEMA = """
CREATE TABLE IF NOT EXISTS bl_conversations (
    id uuid PRIMARY KEY,
    revision integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS bl_items (
    conversation_id uuid NOT NULL REFERENCES bl_conversations ON DELETE CASCADE,
    seq integer NOT NULL,
    position smallint NOT NULL,
    role text,
    content text,
    item json NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, seq, position)
);
"""

HISTORY = "SELECT seq, item FROM bl_items WHERE conversation_id = $1 ORDER BY seq, position"
CREATE = (
    "INSERT INTO bl_conversations (id, revision) VALUES ($1, 1)"
    " ON CONFLICT DO NOTHING RETURNING revision"
)
BUMP = (
    "UPDATE bl_conversations SET revision = revision + 1, updated_at = now()"
    " WHERE id = $1 AND revision = $2 RETURNING revision"
)
ITEMS = (
    "INSERT INTO bl_items (conversation_id, seq, position, role, content, item) VALUES"
    " ($1, $2, 0, 'user', $3, $4), ($1, $2, 1, NULL, NULL, $5), ($1, $2, 2, 'assistant', $6, $7)"
)


class Conflict(Exception):
    pass


class BaselineSubject:
    name = "asyncpg-baseline"
    tables = ("bl_conversations", "bl_items")

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        rows = await self.pool.fetch(HISTORY, conversation)
        assert len(rows) == 3 * history
        revision = rows[-1]["seq"] if rows else 0
        user, reasoning, message = (raw.decode() for raw in payload.raw_items)
        async with self.pool.acquire() as conn, conn.transaction():
            if revision == 0:
                new = await conn.fetchval(CREATE, conversation)
            else:
                new = await conn.fetchval(BUMP, conversation, revision)
            if new is None:
                raise Conflict()
            await conn.execute(
                ITEMS, conversation, new, payload.user_text, user, reasoning,
                payload.assistant_text, message,
            )  # fmt: skip

    async def close(self) -> None:
        await self.pool.close()


async def open_baseline(url: str) -> BaselineSubject:
    pool = await asyncpg.create_pool(libpq_url(url), min_size=10, max_size=20)
    await pool.execute(SCHEMA)
    return BaselineSubject(pool)
