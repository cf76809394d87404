"""The PostgreSQL adapter of the conversation ports: short transactions, a conditional
revision bump per turn, Idempotency-Key claims completed inside that commit.

Every method runs named statements (statements.py, run_statements.py, idempotency.py) on the
asyncpg connection under a pooled one (tx.py) and maps rows with a codec bound to the owner's
data key (rows.py). Here: a turn's way (lease, load, commit) and reads; the other edits are
edits.py's, Idempotency-Keys and operations housekeeping.py's, the shared state adapter.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    StorageError,
    TurnInterrupted,
)
from service.core.model import (
    ANONYMOUS,
    Append,
    Commit,
    Conversation,
    ConversationInfo,
    IdempotencyKey,
    LeaseAttempt,
    LeaseRequest,
    PageRequest,
    Precondition,
    RunCommit,
    Summary,
    TranscriptPage,
    Turn,
)
from service.core.plans import check_precondition
from service.platform.crypto import DataKey
from service.store.cursor import decode_cursor, encode_cursor
from service.store.pages import fitting, page_of
from service.store.postgres import idempotency as idem
from service.store.postgres import run_statements
from service.store.postgres.edits import Edits
from service.store.postgres.housekeeping import Housekeeping
from service.store.postgres.rows import Events, Rows, reading
from service.store.postgres.sealed import writing_key
from service.store.postgres.tx import Params, driver, written


class PostgresStore(Edits, Housekeeping):
    """ConversationStore, IdempotencyStore and Operations over one engine."""

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        params = {"cid": conversation_id, "caller": owner, "after": after_revision}
        async with driver(self._engine, write=False) as conn:
            rows = await self._sql.load.fetch(conn, params)
        if not rows:
            return None
        return await self._conversation(conversation_id, owner, rows, after_revision + 1)

    async def turn(self, conversation_id: UUID, owner: str, revision: int) -> Turn | None:
        params = {"cid": conversation_id, "caller": owner, "seq": revision}
        async with driver(self._engine, write=False) as conn:
            row = await self._sql.turn_of.fetchrow(conn, params)
        if row is None:
            return None
        return (await reading(self._keyring, owner, conversation_id, [row])).turn(row)

    async def turns(
        self, conversation_id: UUID, owner: str, low: int, high: int, *, newest_first: bool,
        limit: int,
    ) -> list[tuple[int, Turn]]:  # fmt: skip
        params = {"cid": conversation_id, "caller": owner, "low": low, "high": high, "n": limit}
        async with driver(self._engine, write=False) as conn:
            rows = await self._sql.turns_of[newest_first].fetch(conn, params)
        if not rows:
            return []
        codec = await reading(self._keyring, owner, conversation_id, rows)
        return [(row["seq"], codec.turn(row)) for row in rows]

    async def turn_sizes(
        self, conversation_id: UUID, owner: str, low: int, high: int
    ) -> list[tuple[int, int | None]]:
        params = {"cid": conversation_id, "caller": owner, "low": low, "high": high}
        async with driver(self._engine, write=False) as conn:
            rows = await self._sql.turn_sizes.fetch(conn, params)
        return [(row["seq"], row["size"]) for row in rows]

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        conversation_id, owner, after_revision = ask.conversation_id, ask.owner, ask.after_revision
        params = {
            "cid": conversation_id, "replaces": ask.replaces, "queue": ask.queue,
            "after": after_revision, **_window_params(ask),
            **self._places.params(owner, ask.holder, ask.lease_s),
        }  # fmt: skip
        folded = await self._places.folded()

        async def take() -> list[asyncpg.Record]:
            async with driver(self._engine, write=False) as conn:  # one statement: autocommit
                return await self._sql.lease[folded].fetch(conn, params)

        rows = await written(take)
        if rows and folded and rows[0]["acquired"] is None and rows[0]["counted"] is None:
            # The lease was given back while the statement waited for its row: its snapshot
            # saw it taken, so it took no place and left the lease free. Ask again at once.
            rows = await written(take)
        if not rows:
            return LeaseAttempt(conversation=None, acquired=False)
        first = rows[0]
        if first["acquired"] and await self._places.apart():  # on the owner's worker
            first = dict(first) | {"counted": await self.take_turn(owner, ask.holder, ask.lease_s)}
            if not first["counted"]:
                await self.release_lease(conversation_id, ask.holder)
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
            "cid": conversation_id, "caller": owner, "after": after_revision,
            **_window_params(ask),
        }  # fmt: skip
        async with driver(self._engine, write=False) as conn:
            rows = await self._sql.load_window.fetch(conn, params)
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
        codec = await reading(self._keyring, owner, conversation_id, found)
        return codec.conversation(rows[0], [codec.turn(row) for row in found], first)

    async def release_lease(self, conversation_id: UUID, holder: UUID) -> None:
        async def release() -> bool:
            async with driver(self._engine, write=False) as conn:
                params = {"cid": conversation_id, "holder": holder}
                return bool(await self._sql.release_lease.fetchval(conn, params))

        if await written(release):  # turns wait for it
            await self._wake([f"lease:{conversation_id}"])

    async def take_turn(self, owner: str, holder: UUID, lease_s: float) -> bool:
        return await self._places.take(owner, holder, lease_s)

    async def free_turn(self, owner: str, holder: UUID) -> None:
        await self._places.free(owner, holder)

    async def renew_turns(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> None:
        await self._places.renew(turns, lease_s)

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        cids, holders = [cid for cid, _ in leases], [holder for _, holder in leases]
        until = datetime.now(UTC) + timedelta(seconds=lease_s)
        params = {"cids": cids, "holders": holders, "until": until}
        async with driver(self._engine, write=False) as conn:
            return {row["id"] for row in await self._sql.renew_leases.fetch(conn, params)}

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
        async with driver(self._engine, write=False) as conn:
            sizes = await self._sql.page_sizes[page.backwards].fetch(conn, params)
            if not sizes:
                return None
            found = [(row["seq"], row["size"]) for row in sizes if row["seq"] is not None]
            if chosen := fitting(found, page):
                seqs = {"cid": conversation_id, "seqs": chosen}
                rows = await self._sql.page_rows.fetch(conn, seqs)
        codec = await reading(self._keyring, owner, conversation_id, rows)
        turns = [codec.transcript_turn(row) for row in rows]
        return page_of(codec.conversation(sizes[0], []), turns, page, fetched=len(found))

    async def append(self, append: Append) -> Commit:
        # Before the transaction: no keyring lookup inside it.
        key = await writing_key(self._keyring, append.owner)
        return await written(lambda: self._append(append, Rows(key, append.conversation_id)))

    async def _append(self, append: Append, codec: Rows) -> Commit:
        """The commit statement (statements.COMMIT); a turn that makes its fork or ends its run
        does those in the same transaction (the run's end rolls it all back if the run was
        interrupted meanwhile), a plain one is that statement alone."""
        cid, expected, run = append.conversation_id, append.expected_revision, append.run
        revision = expected + 1  # the commit's, if it happens (the turn's place for sealing)
        params = {
            **codec.turn_columns(revision, append.turn, run.run_id if run else None),
            "cid": cid, "expected": expected, "context_start": append.turn.context_from,
            "caller": append.owner, "holder": append.lease, "idle_s": self._sql.idle_s,
            "ttl_s": self._idempotency_ttl_s,
            "idem_key": append.idempotency.key if append.idempotency else None,
            "claim": append.idempotency.claim if append.idempotency else None,
            "expires_at": self._expiry(append), "stored_bytes": append.stored_bytes,
        }  # fmt: skip
        wake: list[str] = []  # topics to notify once committed
        plain = append.fork_of is None and run is None
        folded = await self._places.folded()
        async with driver(self._engine, write=not plain) as conn:
            if append.fork_of is not None:
                fork = {"src": append.fork_of.source, "at": append.fork_of.revision,
                        "caller": append.owner, "new": cid}  # fmt: skip
                if await self._copy(conn, fork, codec.key, counted=False) is None:
                    raise await self._why_no_fork(conn, fork)  # the source went meanwhile
            row = await self._sql.commit[folded].fetchrow(conn, params)
            if row is None:
                raise await self._why_not(conn, params)
            if row["lease_wanted"]:  # turns wait for the lease this commit released
                wake.append(f"lease:{cid}")
            if run is not None and await self._end_run(conn, cid, run, revision, codec.key):
                wake.append(f"events:{run.run_id}")  # its events are followed elsewhere
        if append.lease is not None and await self._places.apart():  # on the owner's worker
            with contextlib.suppress(StorageError):  # it stops counting at its ``until``
                await self.free_turn(append.owner, append.lease)
        if wake:
            await self._wake(wake)
        return Commit(row["revision"], row["created_at"], row["updated_at"])

    def _expiry(self, append: Append) -> datetime | None:
        """When a stored response's conversation goes, should this commit make or continue
        one (the commit statement keeps NULL for every other)."""
        if append.stored_response or append.expected_revision > 0 or append.fork_of:
            return datetime.now(UTC) + timedelta(seconds=self._stored_response_ttl_s)
        return None

    async def _end_run(
        self,
        conn: asyncpg.Connection,
        cid: UUID,
        run: RunCommit,
        revision: int,
        key: DataKey | None,
    ) -> bool:
        """The run's end and its message.done, in the commit's transaction; whether a reader
        elsewhere follows it. TurnInterrupted (the whole commit rolled back) if the run was
        interrupted meanwhile."""
        batch = Events(key, run.run_id).batch_columns([run.done.event(run.done_seq, revision)])
        ended = await run_statements.COMMIT.fetchrow(conn, {
            "id": run.run_id, "cid": cid, "status": run.status, "revision": revision,
            "seq": run.done_seq,
            "ttl": self._events_ttl_s, **batch,
        })  # fmt: skip
        if ended is None:
            raise TurnInterrupted()
        return bool(ended[0])

    async def _wake(self, topics: list[str]) -> None:
        # In a transaction of its own: a NOTIFY takes a global lock until its transaction has
        # committed, replication wait included, so inside the commit it would line all commits
        # up behind each other.
        with contextlib.suppress(StorageError):  # those woken look again by themselves
            async with driver(self._engine, write=False) as conn:
                await self._sql.wake.execute(conn, {"topics": topics})

    async def _why_not(self, conn: asyncpg.Connection, params: Params) -> Exception:
        if params["expected"] == 0:
            return ConversationConflict()
        exists = await self._sql.exists.fetchval(conn, params)
        return ConversationConflict() if exists else ConversationNotFound()

    async def delete(
        self,
        conversation_id: UUID,
        owner: str = ANONYMOUS,
        if_match: Precondition = None,
        idempotency: IdempotencyKey | None = None,
    ) -> None:
        await written(lambda: self._delete(conversation_id, owner, if_match, idempotency))

    async def _delete(
        self,
        conversation_id: UUID,
        owner: str,
        if_match: Precondition,
        idempotency: IdempotencyKey | None,
    ) -> None:
        async with driver(self._engine, write=True) as conn:
            params = {"cid": conversation_id, "caller": owner}
            revision = await self._sql.delete.fetchval(conn, params)
            if revision is None:
                raise ConversationNotFound()
            check_precondition(if_match, revision)  # else the delete is rolled back
            cids = {"cids": [conversation_id]}
            await run_statements.DELETE_OF.execute(conn, cids)  # and their events
            await idem.DELETE_OF.execute(conn, params)
            await self._completed(conn, idempotency, None, None)

    async def describe(self, conversation_id: UUID, owner: str) -> ConversationInfo | None:
        async with driver(self._engine, write=False) as conn:
            params = {"cid": conversation_id, "caller": owner}
            row = await self._sql.describe.fetchrow(conn, params)
        return None if row is None else await self._info_of(row, owner)

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None
    ) -> tuple[list[Summary], str | None]:
        """The owner's conversations, newest first, and the cursor of the next page."""
        before_at, before_id = decode_cursor(after)
        params = {"caller": owner, "limit": limit, "before_at": before_at, "before_id": before_id}
        async with driver(self._engine, write=False) as conn:
            rows = await self._sql.page.fetch(conn, params)
        page = [Summary(r["id"], r["revision"], r["created_at"], r["updated_at"]) for r in rows]
        cursor = encode_cursor(page[-1]) if len(page) == limit else None
        return page, cursor


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
