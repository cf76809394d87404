"""The Reads port in PostgreSQL: the conversation without its turns, the owner's listing, a
transcript page, single turns, pages of turns and their sizes; each one short read."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

import asyncpg

from service.core.model import ConversationInfo, PageRequest, Summary, TranscriptPage, Turn
from service.core.search import Finding
from service.core.usage import Usage, UsageTotal
from service.store.cursor import decode_cursor, encode_cursor
from service.store.pages import fitting, page_of
from service.store.postgres import terms
from service.store.postgres.adapter import Adapter
from service.store.postgres.rows import reading
from service.store.postgres.tx import driver


class PostgresReads:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        async with driver(self._db.engine, write=False) as conn:
            params = {"cid": conversation_id, "caller": owner}
            row = await self._db.sql.describe.fetchrow(conn, params)
        return None if row is None else await self._db.info_of(row, owner)

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None, finding: Finding | None = None
    ) -> tuple[list[Summary], str | None]:
        before_at, before_id = decode_cursor(after)
        params = {"caller": owner, "limit": limit, "before_at": before_at, "before_id": before_id}
        filters: tuple[str, ...] = ()
        if finding is not None:
            keyring = self._db.keyring
            key = await keyring.for_read(owner) if keyring and finding.searching else None
            filters, asked = terms.query(key, finding)
            params |= asked
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.listing(filters).fetch(conn, params)
        page = [Summary(r["id"], r["revision"], r["created_at"], r["updated_at"]) for r in rows]
        cursor = encode_cursor(page[-1]) if len(page) == limit else None
        return page, cursor

    async def usage(
        self, owner: str, since: datetime, until: datetime, group_by: str
    ) -> list[UsageTotal]:
        params = {"caller": owner, "since": since, "until": until}
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.usage[group_by].fetch(conn, params)
        return [
            UsageTotal(
                row["key"],
                row["turns"],
                Usage(
                    input_tokens=row["input_tokens"],
                    cached_tokens=row["cached_tokens"],
                    output_tokens=row["output_tokens"],
                    reasoning_tokens=row["reasoning_tokens"],
                    cache_write_tokens=row["cache_write_tokens"],
                    total_tokens=row["input_tokens"] + row["output_tokens"],
                ),
            )
            for row in rows
        ]

    async def transcript(
        self, conversation_id: UUID, owner: str, page: PageRequest
    ) -> TranscriptPage | None:
        params = {
            "cid": conversation_id,
            "caller": owner,
            "after": page.after,
            "before": page.before if page.before is not None else 2**31 - 1,
            "fetch": page.limit + 1,  # one more than asked: is there more?
        }
        rows: list[asyncpg.Record] = []
        async with driver(self._db.engine, write=False) as conn:
            sizes = await self._db.sql.page_sizes[page.backwards].fetch(conn, params)
            if not sizes:
                return None
            found = [(row["seq"], row["size"]) for row in sizes if row["seq"] is not None]
            if chosen := fitting(found, page):
                seqs = {"cid": conversation_id, "seqs": chosen}
                rows = await self._db.sql.page_rows.fetch(conn, seqs)
        codec = await reading(self._db.keyring, owner, conversation_id, rows)
        turns = [codec.transcript_turn(row) for row in rows]
        return page_of(codec.conversation(sizes[0], []), turns, page, fetched=len(found))

    async def turn(self, conversation_id: UUID, owner: str, revision: int) -> Turn | None:
        params = {"cid": conversation_id, "caller": owner, "seq": revision}
        async with driver(self._db.engine, write=False) as conn:
            row = await self._db.sql.turn_of.fetchrow(conn, params)
        if row is None:
            return None
        return (await reading(self._db.keyring, owner, conversation_id, [row])).turn(row)

    async def turns(
        self,
        conversation_id: UUID,
        owner: str,
        low: int,
        high: int,
        *,
        newest_first: bool,
        limit: int,
    ) -> list[tuple[int, Turn]]:
        params = {"cid": conversation_id, "caller": owner, "low": low, "high": high, "n": limit}
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.turns_of[newest_first].fetch(conn, params)
        if not rows:
            return []
        codec = await reading(self._db.keyring, owner, conversation_id, rows)
        return [(row["seq"], codec.turn(row)) for row in rows]

    async def turn_sizes(
        self, conversation_id: UUID, owner: str, low: int, high: int
    ) -> list[tuple[int, int | None]]:
        params = {"cid": conversation_id, "caller": owner, "low": low, "high": high}
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.turn_sizes.fetch(conn, params)
        return [(row["seq"], row["size"]) for row in rows]
