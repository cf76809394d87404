"""The Edits port in PostgreSQL: conversations made without a turn (or with one, on /v1),
forks (forks.py) and metadata."""

from __future__ import annotations

import uuid
from uuid import UUID

from service.core.errors import ConversationNotFound, OwnerShredded
from service.core.export_lines import Imported
from service.core.model import ConversationInfo, IdempotencyKey, Metadata, Precondition, Turn
from service.core.plans import check_precondition
from service.core.sizes import turn_bytes
from service.platform.crypto import DataKey
from service.store.postgres import forks
from service.store.postgres.adapter import Adapter
from service.store.postgres.rows import Rows
from service.store.postgres.sealed import writing_key
from service.store.postgres.terms import Terms
from service.store.postgres.tx import Params, driver, written


class PostgresEdits:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def create_conversation(
        self,
        owner: str,
        metadata: dict[str, str],
        turn: Turn | None = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        key = await writing_key(self._db.keyring, owner)
        return await written(
            lambda: self._create_conversation(owner, metadata, turn, key, idempotency)
        )

    async def _create_conversation(
        self,
        owner: str,
        metadata: dict[str, str],
        turn: Turn | None,
        key: DataKey | None,
        idempotency: IdempotencyKey | None,
    ) -> ConversationInfo:
        codec = Rows(key, made(idempotency))
        revision = 0 if turn is None else 1
        params = {
            "cid": codec.conversation_id,
            "caller": owner,
            "revision": revision,
            "context_start": 1,
            "expires_at": None,
            **codec.metadata_columns(metadata),
            "stored_bytes": turn_bytes(turn) if turn is not None else 0,
            "forked_from": None,
        }
        async with driver(self._db.engine, write=True) as conn:
            row = await self._db.sql.new_conversation.fetchrow(conn, params)
            if row is None:
                raise OwnerShredded()
            if turn is not None:
                await self._db.sql.turn_insert.execute(conn, codec.turn_columns(1, turn, None))
            found = [turn] if turn is not None else []
            await Terms(self._db, conn, codec.conversation_id, key).add(found, metadata or {})
            await self._db.completed(conn, idempotency, codec.conversation_id, revision)
        return codec.info(row)

    async def import_conversation(
        self, owner: str, imported: Imported, idempotency: IdempotencyKey | None = None
    ) -> ConversationInfo:
        key = await writing_key(self._db.keyring, owner)

        async def write() -> ConversationInfo:
            codec = Rows(key, made(idempotency))
            params = {
                "cid": codec.conversation_id,
                "caller": owner,
                "revision": imported.revision,
                "context_start": imported.context_start,
                "expires_at": None,
                **codec.metadata_columns(imported.metadata),
                "stored_bytes": imported.size,
                "forked_from": None,
            }
            turns = [
                codec.turn_columns(turn.number or 0, turn, None) | {"created_at": turn.created_at}
                for turn in imported.turns
            ]
            async with driver(self._db.engine, write=True) as conn:
                row = await self._db.sql.new_conversation.fetchrow(conn, params)
                if row is None:
                    raise OwnerShredded()
                await self._db.sql.turn_move.executemany(conn, turns)
                cid = codec.conversation_id
                await Terms(self._db, conn, cid, key).add(imported.turns, imported.metadata)
                await self._db.completed(conn, idempotency, cid, imported.revision)
            return codec.info(row)

        return await written(write)

    async def fork(
        self,
        conversation_id: UUID,
        owner: str,
        at_revision: int,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        params: Params = {
            "src": conversation_id,
            "caller": owner,
            "at": at_revision,
            "new": made(idempotency),
        }
        key = await writing_key(self._db.keyring, owner)

        async def fork() -> ConversationInfo:
            async with driver(self._db.engine, write=True) as conn:
                row = await forks.copy(self._db, conn, params, key)
                if row is None:
                    raise await forks.why_not(self._db, conn, params)
                await self._db.completed(conn, idempotency, params["new"], at_revision)
                return Rows(key, params["new"]).info(row)

        return await written(fork)

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: Metadata,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        codec = Rows(await writing_key(self._db.keyring, owner), conversation_id)
        params = {"cid": conversation_id, "caller": owner, **codec.metadata_columns(metadata)}

        async def update() -> ConversationInfo:
            async with driver(self._db.engine, write=True) as conn:
                row = await self._db.sql.set_metadata.fetchrow(conn, params)
                if row is None:
                    raise ConversationNotFound()
                check_precondition(if_match, row["revision"])  # else the update is rolled back
                await Terms(self._db, conn, conversation_id, codec.key).pairs(metadata)
                revision = row["revision"]
                await self._db.completed(conn, idempotency, conversation_id, revision)
                return codec.info(row)

        return await written(update)


def made(idempotency: IdempotencyKey | None) -> UUID:
    """The id of a conversation a write makes: the one its Idempotency-Key's claim recorded
    (IdempotencyKey.making), else a new one."""
    if idempotency is not None and idempotency.conversation is not None:
        return idempotency.conversation
    return uuid.uuid4()
