"""The PostgreSQL adapter: short transactions, a conditional revision bump per turn.

Every statement about a conversation filters by its id (the future shard key) and, with
RETENTION_DAYS, by idleness, so an expired conversation is gone at once for every reader
and writer, before `turnstore purge` deletes it.
"""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Any
from uuid import UUID

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    PreconditionFailed,
)
from service.model import (
    ANONYMOUS,
    Commit,
    Conversation,
    IdempotencyKey,
    Origin,
    Precondition,
    Summary,
    Turn,
)
from service.store.idempotency import COMPLETE, completion
from service.store.tables import conversations as c
from service.store.tables import turns as t
from service.store.tx import Compiled, driver, read, transaction
from service.tools.gate import ToolCallRecord

_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_CALLS = msgspec.json.Decoder(list[ToolCallRecord])


class _Statements:
    """The adapter's statements, with the retention rule built in once."""

    def __init__(self, retention_days: float | None) -> None:
        live = (
            c.c.updated_at
            > sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_days * 86_400)
            if retention_days
            else sa.true()
        )
        self.load = (
            sa.select(
                c.c.revision, c.c.created_at, c.c.updated_at, c.c.context_start, c.c.owner,
                t.c.user_message, t.c.assistant_message, t.c.replay_items,
                t.c.provider, t.c.endpoint, t.c.model, t.c.context_from, t.c.prompt_version,
                t.c.tool_calls,
            )
            # Only the turns after :after (0: all); the conversation row comes back even when
            # none is newer, so a cache can revalidate with one query.
            .select_from(c.outerjoin(t, sa.and_(
                t.c.conversation_id == c.c.id, t.c.seq > sa.bindparam("after")
            )))
            .where(c.c.id == sa.bindparam("cid"), live)
            .order_by(t.c.seq)
        )  # fmt: skip
        self.create = (
            insert(c)
            .values(
                id=sa.bindparam("cid"),
                revision=1,
                created_at=sa.func.now(),
                updated_at=sa.func.now(),
                context_start=sa.bindparam("context_start"),
                owner=sa.bindparam("b_owner"),
            )
            .on_conflict_do_nothing()
            .returning(c.c.revision, c.c.created_at, c.c.updated_at)
        )
        self.bump = (
            sa.update(c)
            .where(
                c.c.id == sa.bindparam("cid"),
                c.c.revision == sa.bindparam("expected"),
                c.c.owner == sa.bindparam("b_owner"),
                live,
            )
            .values(
                revision=c.c.revision + 1,
                updated_at=sa.func.now(),
                # The window start only advances, and only together with a committed turn.
                context_start=sa.func.greatest(c.c.context_start, sa.bindparam("context_start")),
            )
            .returning(c.c.revision, c.c.created_at, c.c.updated_at)
        )
        self.exists = sa.select(sa.literal(1)).where(
            c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("b_owner"), live
        )
        self.delete = (
            sa.delete(c)
            .where(c.c.id == sa.bindparam("cid"), c.c.owner == sa.bindparam("b_owner"), live)
            .returning(c.c.revision)
        )
        self.insert_turn = sa.insert(t).values(created_at=sa.func.now())
        self.page = (
            sa.select(c.c.id, c.c.revision, c.c.created_at, c.c.updated_at)
            .where(
                c.c.owner == sa.bindparam("b_owner"),
                live,
                sa.tuple_(c.c.created_at, c.c.id)
                < sa.tuple_(sa.bindparam("before_at"), sa.bindparam("before_id")),
            )
            .order_by(c.c.created_at.desc(), c.c.id.desc())
            .limit(sa.bindparam("limit"))
        )
        expired = sa.select(c.c.id).where(sa.not_(live)).limit(sa.bindparam("batch"))
        self.purge = sa.delete(c).where(
            c.c.id.in_(expired.order_by(c.c.updated_at).with_for_update(skip_locked=True))
        )


class PostgresStore:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        retention_days: float | None = None,
        idempotency_ttl_s: float = 86_400,
    ) -> None:
        self._engine = engine
        self._sql = _Statements(retention_days)
        # The two statements of every turn go straight to the driver (see store/tx.py).
        dialect = engine.dialect
        self._load = Compiled(self._sql.load, dialect)
        self._create = Compiled(self._sql.create, dialect)
        self._bump = Compiled(self._sql.bump, dialect)
        self._insert_turn = Compiled(self._sql.insert_turn, dialect, list(TURN_COLUMNS))
        self._complete = Compiled(COMPLETE, dialect)
        self._exists = Compiled(self._sql.exists, dialect)
        self._retention = retention_days
        self._idempotency_ttl_s = idempotency_ttl_s

    async def load(self, conversation_id: UUID, after_revision: int = 0) -> Conversation | None:
        """The conversation with its turns after ``after_revision`` (all turns by default)."""
        async with driver(self._engine, write=False) as conn:
            args = self._load.args({"cid": conversation_id, "after": after_revision})
            rows = await conn.fetch(self._load.sql, *args)
        if not rows:
            return None
        first = rows[0]
        turns = [
            Turn(
                row["user_message"],
                row["assistant_message"],
                _ITEMS.decode(row["replay_items"]),
                Origin(row["provider"], row["endpoint"], row["model"]) if row["provider"] else None,
                row["context_from"] or 1,
                row["prompt_version"],
                _CALLS.decode(row["tool_calls"]) if row["tool_calls"] else (),
            )
            for row in rows
            if row["replay_items"] is not None
        ]
        return Conversation(
            conversation_id,
            first["revision"],
            first["created_at"],
            first["updated_at"],
            turns,
            first["context_start"],
            first["owner"],
        )

    async def append(
        self,
        conversation_id: UUID,
        turn: Turn,
        expected_revision: int,
        *,
        owner: str = ANONYMOUS,
        idempotency: tuple[IdempotencyKey, str] | None = None,
    ) -> Commit:
        params = {
            "cid": conversation_id,
            "expected": expected_revision,
            "context_start": turn.context_from,
            "b_owner": owner,
        }
        statement = self._create if expected_revision == 0 else self._bump
        async with driver(self._engine, write=True) as conn:
            row = await conn.fetchrow(statement.sql, *statement.args(params))
            if row is None:
                raise await self._why_not(conn, params)
            new_turn = _turn_row(conversation_id, row["revision"], turn)
            await conn.execute(self._insert_turn.sql, *self._insert_turn.args(new_turn))
            if idempotency is not None:
                done = completion(*idempotency, self._idempotency_ttl_s)
                await conn.execute(self._complete.sql, *self._complete.args(done))
        return Commit(row["revision"], row["created_at"], row["updated_at"])

    async def _why_not(self, conn: Any, params: dict[str, Any]) -> Exception:
        if params["expected"] == 0:
            return ConversationConflict()
        exists = await conn.fetchval(self._exists.sql, *self._exists.args(params))
        return ConversationConflict() if exists else ConversationNotFound()

    async def delete(
        self, conversation_id: UUID, owner: str = ANONYMOUS, if_match: Precondition = None
    ) -> None:
        async with transaction(self._engine) as conn:
            params = {"cid": conversation_id, "b_owner": owner}
            revision = await conn.scalar(self._sql.delete, params)
            if revision is None:
                raise ConversationNotFound()
            if if_match is not None and revision not in if_match:
                raise PreconditionFailed()  # rolls the delete back

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None
    ) -> tuple[list[Summary], str | None]:
        """The owner's conversations, newest first, and the cursor of the next page."""
        before_at, before_id = _decode_cursor(after)
        params = {"b_owner": owner, "limit": limit, "before_at": before_at, "before_id": before_id}
        async with read(self._engine) as conn:
            rows = (await conn.execute(self._sql.page, params)).all()
        page = [Summary(r.id, r.revision, r.created_at, r.updated_at) for r in rows]
        cursor = _encode_cursor(page[-1]) if len(page) == limit else None
        return page, cursor

    async def purge(self, batch: int = 500) -> int:
        """Delete conversations idle past the retention, a small batch per transaction so
        no lock is held long; concurrent purges skip each other's rows."""
        if not self._retention:
            return 0
        total = 0
        while True:
            async with transaction(self._engine) as conn:
                deleted = (await conn.execute(self._sql.purge, {"batch": batch})).rowcount
                await conn.execute(sa.text("DELETE FROM idempotency_keys WHERE expires_at < now()"))
            total += deleted
            if deleted < batch:
                return total

    async def schema_revision(self) -> str | None:
        async with transaction(self._engine) as conn:
            exists = await conn.scalar(sa.text("SELECT to_regclass('alembic_version')"))
            if exists is None:
                return None
            version = await conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
            return str(version) if version is not None else None

    def pool_in_use(self) -> int:
        return self._engine.sync_engine.pool.checkedout()  # type: ignore[attr-defined,no-any-return]

    async def close(self) -> None:
        await self._engine.dispose()


TURN_COLUMNS = (
    "conversation_id", "seq", "user_message", "assistant_message", "replay_items",
    "provider", "endpoint", "model", "context_from", "prompt_version", "tool_calls",
)  # fmt: skip


def _turn_row(conversation_id: UUID, seq: int, turn: Turn) -> dict[str, object]:
    return {
        "conversation_id": conversation_id,
        "seq": seq,
        "user_message": turn.user_message,
        "assistant_message": turn.assistant_message,
        "replay_items": msgspec.json.encode(turn.replay_items).decode(),
        "provider": turn.origin.provider if turn.origin else None,
        "endpoint": turn.origin.endpoint if turn.origin else None,
        "model": turn.origin.model if turn.origin else None,
        "context_from": turn.context_from,
        "prompt_version": turn.prompt_version,
        "tool_calls": msgspec.json.encode(turn.tool_calls).decode() if turn.tool_calls else None,
    }


_FAR_FUTURE = (datetime.max.replace(year=9999), UUID(int=(1 << 128) - 1))


def _encode_cursor(last: Summary) -> str:
    raw = f"{last.created_at.isoformat()}|{last.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> tuple[datetime, UUID]:
    if cursor is None:
        return _FAR_FUTURE
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, ident = raw.partition("|")
        return datetime.fromisoformat(at), UUID(ident)
    except ValueError:
        raise InvalidInput("after is not a cursor this API returned.") from None
