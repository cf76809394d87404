"""PostgresStore's edits besides a turn's commit: conversations made without a turn (or with
one, on /v1), forks, the removal of the latest item and metadata."""

from __future__ import annotations

import logging
import math
import uuid
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg
import msgspec

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    OwnerShredded,
    StorageError,
    TooManyRequests,
)
from service.core.items import without_last_item
from service.core.model import ConversationInfo, IdempotencyKey, Metadata, Precondition, Turn
from service.core.plans import check_precondition
from service.core.sizes import held_bytes, turn_bytes
from service.platform.crypto import DataKey
from service.store.postgres.adapter import Adapter
from service.store.postgres.rows import Rows
from service.store.postgres.sealed import writing_key
from service.store.postgres.tx import Params, driver, written

log = logging.getLogger("turnstore.store")
FORK_WINDOW = timedelta(minutes=1)  # OWNER_MAX_FORKS_PER_MINUTE's


class Edits(Adapter):
    async def create_conversation(
        self,
        owner: str,
        metadata: dict[str, str],
        turn: Turn | None = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        key = await writing_key(self._keyring, owner)
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
        codec = Rows(key, uuid.uuid4())
        revision = 0 if turn is None else 1
        params = {
            "cid": codec.conversation_id, "caller": owner, "revision": revision,
            "context_start": 1, "expires_at": None, **codec.metadata_columns(metadata),
            "stored_bytes": turn_bytes(turn) if turn is not None else 0,
        }  # fmt: skip
        async with driver(self._engine, write=True) as conn:
            row = await self._sql.new_conversation.fetchrow(conn, params)
            if row is None:
                raise OwnerShredded()
            if turn is not None:
                await self._sql.turn_insert.execute(conn, codec.turn_columns(1, turn, None))
            await self._completed(conn, idempotency, codec.conversation_id, revision)
        return codec.info(row)

    async def fork(
        self,
        conversation_id: UUID,
        owner: str,
        at_revision: int,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        params: Params = {
            "src": conversation_id, "caller": owner, "at": at_revision, "new": uuid.uuid4()
        }  # fmt: skip
        key = await writing_key(self._keyring, owner)

        async def fork() -> ConversationInfo:
            async with driver(self._engine, write=True) as conn:
                row = await self._copy(conn, params, key)
                if row is None:
                    raise await self._why_no_fork(conn, params)
                await self._completed(conn, idempotency, params["new"], at_revision)
                return Rows(key, params["new"]).info(row)

        return await written(fork)

    async def take_fork(self, owner: str, conversation_id: UUID) -> None:
        if self._forks_per_minute is None:
            return
        fork = {"caller": owner, "new": conversation_id}

        async def take() -> None:
            async with driver(self._engine, write=True) as conn:
                await self._fork_slot(conn, fork, self._forks_per_minute or 0)

        await written(take)

    async def free_fork(self, owner: str, conversation_id: UUID) -> None:
        if self._forks_per_minute is None:
            return
        async with driver(self._engine, write=False) as conn:
            await self._sql.free_fork.execute(conn, {"caller": owner, "new": conversation_id})

    async def _copy(
        self, conn: asyncpg.Connection, fork: Params, key: DataKey | None, *, counted: bool = True
    ) -> asyncpg.Record | None:
        """Make conversation :new as :src up to revision :at; its new row, or None if :src is
        gone or not that far. In clear, one statement copies it inside the database; sealed,
        each value is opened and sealed again for its new place. TooManyRequests past
        OWNER_MAX_FORKS_PER_MINUTE (``counted``: the fork's place among them is taken here;
        a turn's fork took it before its provider call, ``take_fork``)."""
        if self._forks_per_minute is not None and counted:
            await self._fork_slot(conn, fork, self._forks_per_minute)
        if key is None:
            return await self._sql.fork.fetchrow(conn, fork)
        source = await self._sql.fork_source.fetchrow(conn, fork)
        if source is None:
            return None
        old, new = Rows(key, fork["src"]), Rows(key, fork["new"])
        turns = [(row, old.turn(row)) for row in await self._sql.fork_turns.fetch(conn, fork)]
        row = await self._sql.new_conversation.fetchrow(conn, {
            "cid": new.conversation_id, "revision": fork["at"], "caller": fork["caller"],
            "context_start": source["context_from"] or 1, "expires_at": source["expires_at"],
            **new.metadata_columns(old.metadata(source)),
            "stored_bytes": held_bytes(turn for _, turn in turns),
        })  # fmt: skip
        if row is None:  # the owner was shredded (see _why_no_fork)
            return None
        copies = [
            new.turn_columns(found["seq"], turn, None) | {"created_at": found["turn_created_at"]}
            for found, turn in turns
        ]
        await self._sql.turn_move.executemany(conn, copies)
        return row

    async def _fork_slot(self, conn: asyncpg.Connection, fork: Params, most: int) -> None:
        """This fork counted against its owner's last minute (statements.FORK_SLOT), or
        TooManyRequests with the seconds until the oldest of them leaves the minute."""
        now = datetime.now(UTC)
        await self._sql.fork_turnstile.execute(conn, {"caller": fork["caller"]})
        slot = await self._sql.fork_slot.fetchrow(conn, {
            "caller": fork["caller"], "new": fork["new"], "now": now,
            "since": now - FORK_WINDOW, "max": most,
        })  # fmt: skip
        assert slot is not None  # the statement answers one row
        if not slot["made"]:
            wait = slot["oldest"] + FORK_WINDOW - now if slot["oldest"] else FORK_WINDOW
            raise TooManyRequests(
                f"At most {most} forks a minute (OWNER_MAX_FORKS_PER_MINUTE).",
                retry_after=str(max(1, math.ceil(wait.total_seconds()))),
            )

    async def _why_no_fork(self, conn: asyncpg.Connection, fork: Params) -> Exception:
        if await self._sql.describe.fetchrow(conn, {"cid": fork["src"], **fork}) is None:
            return ConversationNotFound()
        if await self._sql.shredded.fetchval(conn, fork):
            return OwnerShredded()
        if self._keyring is None and await self._sql.sealed_source.fetchval(conn, fork):
            log.error("a fork of an encrypted conversation needs ENCRYPTION_KEYS_FILE")
            return StorageError("The conversation is encrypted and the keys are not available.")
        return InvalidInput("at_revision must be a revision of the conversation.")

    async def pop_item(
        self,
        conversation_id: UUID,
        owner: str,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        codec = Rows(await writing_key(self._keyring, owner), conversation_id)

        async def pop() -> tuple[ConversationInfo, msgspec.Raw]:
            async with driver(self._engine, write=True) as conn:
                info, item = await self._pop(conn, codec, owner, if_match)
                await self._completed(conn, idempotency, info.id, info.revision)
                return info, item

        return await written(pop)

    async def _pop(
        self,
        conn: asyncpg.Connection,
        codec: Rows,
        owner: str,
        if_match: Precondition,
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        """Removing the latest item: the row locked, the last turn read, rewritten."""
        cid = codec.conversation_id
        head = await self._sql.lock_head.fetchrow(conn, {"cid": cid, "caller": owner})
        if head is None:
            raise ConversationNotFound()
        check_precondition(if_match, head["revision"])
        if head["leased"]:
            raise ConversationConflict()  # a turn runs: it would commit on top
        last = {"cid": cid, "seq": head["revision"]}
        row = await self._sql.turn_at.fetchrow(conn, last)
        last_turn = codec.turn(row) if row is not None else None
        if row is None or last_turn is None or not last_turn.replay_items:
            raise InvalidInput("The conversation has no item to remove.", param="item_id")
        await self._sql.delete_turn.execute(conn, last)
        moved = codec.turn_columns(
            head["revision"] + 1, without_last_item(last_turn), row["turn_id"]
        )
        await self._sql.turn_move.execute(conn, moved | {"created_at": row["turn_created_at"]})
        done = await self._sql.rewritten.fetchrow(conn, {"cid": cid})
        return codec.info(done), last_turn.replay_items[-1]

    async def update_metadata(
        self,
        conversation_id: UUID,
        owner: str,
        metadata: Metadata,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        codec = Rows(await writing_key(self._keyring, owner), conversation_id)
        params = {"cid": conversation_id, "caller": owner, **codec.metadata_columns(metadata)}

        async def update() -> ConversationInfo:
            async with driver(self._engine, write=True) as conn:
                row = await self._sql.set_metadata.fetchrow(conn, params)
                if row is None:
                    raise ConversationNotFound()
                check_precondition(if_match, row["revision"])  # else the update is rolled back
                revision = row["revision"]
                await self._completed(conn, idempotency, conversation_id, revision)
                return codec.info(row)

        return await written(update)

    async def delete_response(
        self,
        conversation_id: UUID,
        owner: str,
        revision: int,
        idempotency: IdempotencyKey | None = None,
        *,
        erase: bool = False,
    ) -> bool:
        params = {"cid": conversation_id, "caller": owner, "seq": revision}
        statement = self._sql.delete_response[erase]

        async def delete() -> bool:
            # One statement, autocommitted; with a key, in one transaction with its completion.
            async with driver(self._engine, write=idempotency is not None) as conn:
                found = await statement.fetchrow(conn, params) is not None
                await self._completed(conn, idempotency, conversation_id, revision)
                return found

        return await written(delete)
