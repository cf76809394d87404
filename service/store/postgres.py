"""The PostgreSQL adapter: short transactions, a conditional revision bump per turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from uuid import UUID

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.errors import (
    ConversationConflict,
    ConversationNotFound,
    PreconditionFailed,
    StorageError,
)
from service.model import Commit, Conversation, Origin, Precondition, Turn
from service.store.tables import conversations as c
from service.store.tables import turns as t
from service.tools.gate import ToolCallRecord

_LOAD = (
    sa.select(
        c.c.revision, c.c.created_at, c.c.updated_at, c.c.context_start,
        t.c.user_message, t.c.assistant_message, t.c.replay_items,
        t.c.provider, t.c.endpoint, t.c.model, t.c.context_from, t.c.prompt_version,
        t.c.tool_calls,
    )
    # Only the turns after :after (0: all of them); the conversation row comes back even when
    # none is newer, so a cache can revalidate with one query.
    .select_from(
        c.outerjoin(t, sa.and_(t.c.conversation_id == c.c.id, t.c.seq > sa.bindparam("after")))
    )
    .where(c.c.id == sa.bindparam("cid"))
    .order_by(t.c.seq)
)  # fmt: skip

_CREATE = (
    insert(c)
    .values(
        id=sa.bindparam("cid"),
        revision=1,
        created_at=sa.func.now(),
        updated_at=sa.func.now(),
        context_start=sa.bindparam("context_start"),
    )
    .on_conflict_do_nothing()
    .returning(c.c.revision, c.c.created_at, c.c.updated_at)
)

_BUMP = (
    sa.update(c)
    .where(c.c.id == sa.bindparam("cid"), c.c.revision == sa.bindparam("expected"))
    .values(
        revision=c.c.revision + 1,
        updated_at=sa.func.now(),
        # The window start only advances, and only together with a committed turn.
        context_start=sa.func.greatest(c.c.context_start, sa.bindparam("context_start")),
    )
    .returning(c.c.revision, c.c.created_at, c.c.updated_at)
)

_INSERT_TURN = sa.insert(t).values(created_at=sa.func.now())

_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_CALLS = msgspec.json.Decoder(list[ToolCallRecord])


class PostgresStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection]:
        """One short transaction. Any database failure becomes StorageError, and the
        connection it happened on is discarded: after a failover or a restart the pool must
        not hand out a session that is read-only or half-dead."""
        try:
            async with self._engine.connect() as conn:
                try:
                    async with conn.begin():
                        yield conn
                except sa.exc.DBAPIError:
                    await conn.invalidate()
                    raise
        except (sa.exc.DBAPIError, sa.exc.TimeoutError, OSError, TimeoutError) as exc:
            raise StorageError() from exc

    async def load(self, conversation_id: UUID, after_revision: int = 0) -> Conversation | None:
        """The conversation with its turns after ``after_revision`` (all turns by default)."""
        async with self._transaction() as conn:
            params = {"cid": conversation_id, "after": after_revision}
            rows = (await conn.execute(_LOAD, params)).all()
        if not rows:
            return None
        first = rows[0]
        turns = [
            Turn(
                row.user_message,
                row.assistant_message,
                _ITEMS.decode(row.replay_items),
                Origin(row.provider, row.endpoint, row.model) if row.provider else None,
                row.context_from or 1,
                row.prompt_version,
                _CALLS.decode(row.tool_calls) if row.tool_calls else (),
            )
            for row in rows
            if row.replay_items is not None
        ]
        return Conversation(
            conversation_id,
            first.revision,
            first.created_at,
            first.updated_at,
            turns,
            first.context_start,
        )

    async def append(self, conversation_id: UUID, turn: Turn, expected_revision: int) -> Commit:
        async with self._transaction() as conn:
            params = {
                "cid": conversation_id,
                "expected": expected_revision,
                "context_start": turn.context_from,
            }
            if expected_revision == 0:
                row = (await conn.execute(_CREATE, params)).first()
            else:
                row = (await conn.execute(_BUMP, params)).first()
            if row is None:
                raise await self._why_not(conn, conversation_id, expected_revision)
            await conn.execute(
                _INSERT_TURN,
                {
                    "conversation_id": conversation_id,
                    "seq": row.revision,
                    "user_message": turn.user_message,
                    "assistant_message": turn.assistant_message,
                    "replay_items": msgspec.json.encode(turn.replay_items).decode(),
                    "provider": turn.origin.provider if turn.origin else None,
                    "endpoint": turn.origin.endpoint if turn.origin else None,
                    "model": turn.origin.model if turn.origin else None,
                    "context_from": turn.context_from,
                    "prompt_version": turn.prompt_version,
                    "tool_calls": msgspec.json.encode(turn.tool_calls).decode()
                    if turn.tool_calls
                    else None,
                },
            )
        return Commit(row.revision, row.created_at, row.updated_at)

    @staticmethod
    async def _why_not(conn: AsyncConnection, conversation_id: UUID, expected: int) -> Exception:
        if expected == 0:
            return ConversationConflict()
        exists = await conn.scalar(sa.select(sa.literal(1)).where(c.c.id == conversation_id))
        return ConversationConflict() if exists else ConversationNotFound()

    async def delete(self, conversation_id: UUID, if_match: Precondition = None) -> None:
        async with self._transaction() as conn:
            revision = await conn.scalar(
                sa.delete(c).where(c.c.id == conversation_id).returning(c.c.revision)
            )
            if revision is None:
                raise ConversationNotFound()
            if if_match is not None and revision not in if_match:
                raise PreconditionFailed()  # rolls the delete back

    async def schema_revision(self) -> str | None:
        async with self._transaction() as conn:
            exists = await conn.scalar(sa.text("SELECT to_regclass('alembic_version')"))
            if exists is None:
                return None
            version = await conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
            return str(version) if version is not None else None

    def pool_in_use(self) -> int:
        return self._engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined,no-any-return]

    async def close(self) -> None:
        await self._engine.dispose()
