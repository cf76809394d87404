"""The History port in PostgreSQL: a conversation's committed turns, read whole (``load``) or as
a turn reads them, with its lease (``lease``), and changed: a turn's commit (commit.py), the
conversation deleted, its latest item removed, a response forgotten or erased."""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID

import asyncpg
import msgspec

from service.core.errors import ConversationConflict, ConversationNotFound, InvalidInput
from service.core.items import without_last_item
from service.core.model import (
    ANONYMOUS,
    Append,
    Commit,
    Conversation,
    ConversationInfo,
    LeaseAttempt,
    LeaseRequest,
    Precondition,
    Removal,
    Turn,
)
from service.core.plans import check_precondition
from service.store.postgres import commit, receipts, run_homes
from service.store.postgres import idempotency as idem
from service.store.postgres.adapter import Adapter
from service.store.postgres.places import release
from service.store.postgres.rows import Rows, reading
from service.store.postgres.sealed import writing_key
from service.store.postgres.terms import Terms
from service.store.postgres.tx import Params, driver, written


class PostgresHistory:
    def __init__(self, db: Adapter) -> None:
        self._db = db

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        params = {"cid": conversation_id, "caller": owner, "after": after_revision}
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.load.fetch(conn, params)
        if not rows:
            return None
        return await self._conversation(conversation_id, owner, rows, after_revision + 1)

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        conversation_id, owner, after_revision = ask.conversation_id, ask.owner, ask.after_revision
        places = self._db.places
        params = {
            "cid": conversation_id,
            "replaces": ask.replaces,
            "queue": ask.queue,
            "after": after_revision,
            **_window_params(ask),
            **places.params(owner, ask.holder, ask.lease_s),
        }
        folded = await places.folded()

        async def take() -> list[asyncpg.Record]:
            async with driver(self._db.engine, write=False) as conn:  # one statement: autocommit
                return await self._db.sql.lease[folded, ask.run].fetch(conn, params)

        rows = await written(take)
        if rows and folded and rows[0]["acquired"] is None and rows[0]["counted"] is None:
            # The lease was given back while the statement waited for its row: its snapshot
            # saw it taken, so it took no place and left the lease free. Ask again at once.
            rows = await written(take)
        if not rows:
            return LeaseAttempt(conversation=None, acquired=False)
        first = rows[0]
        if first["acquired"] and await places.apart():  # on the coordinator
            first = dict(first) | {"counted": await places.take(owner, ask.holder, ask.lease_s)}
            if not first["counted"]:
                await release(self._db, conversation_id, ask.holder)
        if first["counted"] is False:  # the owner runs OWNER_MAX_RUNNING_TURNS turns
            return LeaseAttempt(conversation=None, acquired=False, crowded=True)
        busy_until = None if first["acquired"] else first["lease_expires_at"]
        conversation = await self._conversation(
            conversation_id, owner, rows, _window_first(rows, after_revision)
        )
        if not conversation.complete:
            # A commit raced the statement: its turn is not in the statement's snapshot (the
            # revision is the updated row's). Read again: callers (and the history cache)
            # must never get a revision ahead of its turns.
            again = await self._window(conversation_id, owner, after_revision, ask)
            return LeaseAttempt(again, first["acquired"] and again is not None, busy_until)
        return LeaseAttempt(conversation, first["acquired"], busy_until)

    async def _window(
        self, conversation_id: UUID, owner: str, after_revision: int, ask: LeaseRequest
    ) -> Conversation | None:
        """The conversation with the turns a turn reads (as ``lease``), without the lease."""
        params = {
            "cid": conversation_id,
            "caller": owner,
            "after": after_revision,
            **_window_params(ask),
        }
        async with driver(self._db.engine, write=False) as conn:
            rows = await self._db.sql.load_window.fetch(conn, params)
        if not rows:
            return None
        return await self._conversation(
            conversation_id, owner, rows, _window_first(rows, after_revision)
        )

    async def _conversation(
        self, conversation_id: UUID, owner: str, rows: Sequence[asyncpg.Record], first: int
    ) -> Conversation:
        """The conversation of rows read with statements.HEAD and TURN (a row without a turn:
        the conversation alone), whose turns were asked from revision ``first`` on."""
        found = [row for row in rows if row["seq"] is not None]
        codec = await reading(self._db.keyring, owner, conversation_id, found)
        return codec.conversation(rows[0], [codec.turn(row) for row in found], first)

    async def append(self, append: Append) -> Commit:
        # Before the transaction: no keyring lookup inside it.
        key = await writing_key(self._db.keyring, append.owner)
        return await written(
            lambda: commit.commit(self._db, append, Rows(key, append.conversation_id))
        )

    async def delete(self, removal: Removal, if_match: Precondition = None) -> None:
        await written(lambda: self._delete(removal, if_match))

    async def _delete(self, removal: Removal, if_match: Precondition) -> None:
        conversation_id, idempotency = removal.conversation_id, removal.idempotency
        async with driver(self._db.engine, write=True) as conn:
            params = {"cid": conversation_id, "caller": removal.owner}
            revision = await self._db.sql.delete.fetchval(conn, params)
            if revision is None:
                raise ConversationNotFound()
            check_precondition(if_match, revision)  # else the delete is rolled back
            await run_homes.delete_of(self._db, conn, [conversation_id])  # and their events
            await receipts.delete_of(self._db, conn, [conversation_id])  # before this one's
            await idem.DELETE_OF.execute(conn, params)
            await self._db.completed(conn, idempotency, None, None)

    async def pop_item(
        self, removal: Removal, if_match: Precondition = None
    ) -> tuple[ConversationInfo, msgspec.Raw]:
        owner, idempotency = removal.owner, removal.idempotency
        codec = Rows(await writing_key(self._db.keyring, owner), removal.conversation_id)

        async def pop() -> tuple[ConversationInfo, msgspec.Raw]:
            async with driver(self._db.engine, write=True) as conn:
                info, item = await self._pop(conn, codec, owner, if_match)
                await self._db.completed(conn, idempotency, info.id, info.revision)
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
        cid, sql = codec.conversation_id, self._db.sql
        head = await sql.lock_head.fetchrow(conn, {"cid": cid, "caller": owner})
        if head is None:
            raise ConversationNotFound()
        check_precondition(if_match, head["revision"])
        if head["leased"]:
            raise ConversationConflict()  # a turn runs: it would commit on top
        last = {"cid": cid, "seq": head["revision"]}
        row = await sql.turn_at.fetchrow(conn, last)
        last_turn = codec.turn(row) if row is not None else None
        if row is None or last_turn is None or not last_turn.replay_items:
            raise InvalidInput("The conversation has no item to remove.", param="item_id")
        await sql.delete_turn.execute(conn, last)
        moved = codec.turn_columns(
            head["revision"] + 1, without_last_item(last_turn), row["turn_id"]
        )
        await sql.turn_move.execute(conn, moved | {"created_at": row["turn_created_at"]})
        done = await sql.rewritten.fetchrow(conn, {"cid": cid})
        await self._search_again(conn, codec, done)
        return codec.info(done), last_turn.replay_items[-1]

    async def _search_again(
        self, conn: asyncpg.Connection, codec: Rows, done: asyncpg.Record
    ) -> None:
        """The conversation's search terms made again from what it holds now: the removed
        item's words find it no more (sealed, each turn is opened for its words' digests)."""
        cid, sealed = codec.conversation_id, list[Turn]()
        if codec.key is not None:
            rows = await self._db.sql.fork_turns.fetch(conn, {"src": cid, "at": done["revision"]})
            sealed = [codec.turn(row) for row in rows]
        await Terms(self._db, conn, cid, codec.key).rebuild(sealed, codec.metadata(done))

    async def delete_response(
        self, removal: Removal, revision: int, *, erase: bool = False
    ) -> bool:
        conversation_id, idempotency = removal.conversation_id, removal.idempotency
        params = {"cid": conversation_id, "caller": removal.owner, "seq": revision}
        statement = self._db.sql.delete_response[erase]

        async def delete() -> bool:
            # One statement, autocommitted; with a key, in one transaction with its completion.
            async with driver(self._db.engine, write=idempotency is not None) as conn:
                found = await statement.fetchrow(conn, params) is not None
                await self._db.completed(conn, idempotency, conversation_id, revision)
                return found

        return await written(delete)


def _window_first(rows: Sequence[asyncpg.Record], after_revision: int) -> int:
    """The first revision a turn's window read holds: after what the caller holds, from the
    window start on, or from where the read stopped going back (statements.window_cut)."""
    read = [row["seq"] for row in rows if row["seq"] is not None]
    return max(after_revision + 1, int(rows[0]["context_start"]), min(read, default=0))


def _window_params(ask: LeaseRequest) -> Params:
    """How far back a turn's window read goes (statements.window_cut): the bytes its request
    may carry, to the origin it is for."""
    origin = ask.window_origin
    return {
        "window_bytes": ask.window_bytes,
        "provider": origin.provider if origin else None,
        "endpoint": origin.endpoint if origin else None,
        "model": origin.model if origin else None,
    }
