"""Durable turns in PostgreSQL: runs and their events, the RunWrites and RunReads ports, each
over one adapter value and where its runs are (``KnownRuns``, run_homes.py); the statements
are run_statements.py's, the commit's part is commit.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import asyncpg
import msgspec

from service.core.errors import ConversationNotFound, OwnerShredded, StorageError
from service.core.events import ERROR, RunEvent
from service.core.model import NewRun, Renewed, RunEnd, RunView
from service.core.plans import check_precondition
from service.platform.crypto import DataKey
from service.store.postgres import run_homes
from service.store.postgres import run_statements as sql
from service.store.postgres.adapter import Adapter, merged
from service.store.postgres.rows import Events
from service.store.postgres.run_homes import KnownRuns
from service.store.postgres.sealed import (
    get,
    put,
    reading_key,
    run_response_place,
    turn_place,
    writing_key,
)
from service.store.postgres.tx import Compiled, driver, written

# The columns of a run's row (run_statements.VIEW) a RunView holds as read, by the same name.
_AS_READ = (
    "id", "conversation_id", "status", "revision", "error_code", "error_message",
    "last_event", "background", "stalled", "base_revision", "message_id",
)  # fmt: skip


def view(row: Any, key: DataKey | None, message: str | None = None) -> RunView:
    where = run_response_place(row["id"])
    response = get(key, where, row["response"], row["sealed_response"])
    return RunView(
        message=message,
        response=msgspec.Raw(response.encode()) if response else None,
        created_at=row["run_created_at"],
        **{name: row[name] for name in _AS_READ},
    )


class PostgresRunWrites:
    def __init__(self, db: Adapter, known: KnownRuns) -> None:
        self._db = db  # events are sealed under their owner's key with a keyring
        self._known = known

    async def create_run(self, run: NewRun, heartbeat_s: float, *, counted: bool = True) -> bool:
        key = await writing_key(self._db.keyring, run.owner) if run.response else None
        text = bytes(run.response).decode() if run.response else None
        clear, sealed = put(key, run_response_place(run.id), text)
        params = {
            "id": run.id,
            "cid": run.conversation_id,
            "owner": run.owner,
            "background": run.background,
            "hb": heartbeat_s,
            "response": clear,
            "sealed_response": sealed,
        }
        places = self._db.places
        if counted and await places.folded():
            place = {**params, **places.params(run.owner, run.id, heartbeat_s)}
            if run.existing:  # the conversation's check in the same statement
                place["if_match"] = sorted(run.if_match) if run.if_match is not None else None
                rows = await self._rows(self._db.sql.living(sql.CREATE_COUNTED_IN), place)
                if not rows:
                    raise ConversationNotFound()
                check_precondition(run.if_match, rows[0]["revision"])
            else:
                rows = await self._rows(sql.CREATE_COUNTED, place)
            if not rows[0]["taken"]:
                return False
        else:  # Citus: the place first, on the coordinator
            if run.existing:  # the conversation's check, a statement of its own
                await self._exists(run)
            apart = counted and await places.apart()
            if apart and not await places.take(run.owner, run.id, heartbeat_s):
                return False
            if not await self._write(await run_homes.creating(self._db), params):
                raise OwnerShredded()
        self._known.learn(run.id, run.conversation_id)
        return True

    async def _exists(self, run: NewRun) -> None:
        """ConversationNotFound, PreconditionFailed: as NewRun.existing asks."""
        async with driver(self._db.engine, write=False) as conn:
            params = {"cid": run.conversation_id, "caller": run.owner}
            row = await self._db.sql.describe.fetchrow(conn, params)
        if row is None:
            raise ConversationNotFound()
        check_precondition(run.if_match, row["revision"])

    async def begin_run(self, run_id: UUID, revision: int) -> None:
        await self._write(sql.BEGIN, {**(await self._known.at(run_id)), "base": revision})

    async def log_events(
        self, run_id: UUID, owner: str, events: Sequence[RunEvent], message_id: str | None = None
    ) -> None:
        batch = (await self._events(owner, run_id)).batch_columns(events)
        at = await self._known.at(run_id)
        params = {**at, "last": events[-1].seq, "message_id": message_id, **batch}
        await self._logged(run_id, await self._rows(sql.LOG, params))

    async def end_run(self, run_id: UUID, owner: str, end: RunEnd) -> bool:
        batch = (await self._events(owner, run_id)).batch_columns(end.events)
        params = {
            **(await self._known.at(run_id)),
            "status": end.status,
            "code": end.error_code,
            "message": end.error_message,
            "last": end.events[-1].seq,
            "ttl": self._db.config.events_ttl_s,
            "revision": end.revision,
            **batch,
        }
        return await self._logged(run_id, await self._rows(sql.END, params))

    async def renew_runs(self, run_ids: Sequence[UUID], heartbeat_s: float) -> Renewed:
        batches = [{**batch, "hb": heartbeat_s} for batch in await self._known.among(run_ids)]
        rows = await self._db.each_group(sql.RENEW, batches)
        return Renewed(
            frozenset(row["id"] for row in rows if row["cancel_requested"]),
            frozenset(row["id"] for row in rows if row["watched"]),
        )

    async def cancel_run(self, run_id: UUID, owner: str) -> bool:
        if not await self._rows(sql.CANCEL, {**(await self._known.at(run_id)), "owner": owner}):
            return False
        await self._notify(f"cancel:{run_id}")
        return True

    async def watch_run(self, run_id: UUID) -> None:
        if await self._rows(sql.WATCH, await self._known.at(run_id)):
            await self._notify(f"watch:{run_id}")

    async def interrupt_run(self, run_id: UUID, owner: str, message: str, event_data: str) -> bool:
        events, at = await self._events(owner, run_id), await self._known.at(run_id)

        async def interrupt() -> list[asyncpg.Record]:
            async with driver(self._db.engine, write=False) as conn:
                last = await sql.STALLED.fetchval(conn, at)
                if last is None:
                    return []  # alive, or ended meanwhile
                batch = events.batch_columns([RunEvent(last, ERROR, event_data)])
                ttl = self._db.config.events_ttl_s
                params = {**at, "message": message, "ttl": ttl, "last": last}
                return await sql.INTERRUPT.fetch(conn, {**params, **batch})

        return await self._logged(run_id, await written(interrupt))

    async def forget_run(self, run_id: UUID, owner: str) -> None:
        await run_homes.forget(self._db, {**(await self._known.at(run_id)), "owner": owner})

    async def _events(self, owner: str, run_id: UUID) -> Events:
        """The run's batches as ``owner``'s new values are written: sealed with a keyring."""
        return Events(await writing_key(self._db.keyring, owner), run_id)

    async def _write(self, statement: Compiled, params: dict[str, Any]) -> int:
        """One statement (autocommit), retried on a stale read-only session; its rows."""
        return len(await self._rows(statement, params))

    async def _rows(self, statement: Compiled, params: dict[str, Any]) -> list[asyncpg.Record]:
        async def once() -> list[asyncpg.Record]:
            async with driver(self._db.engine, write=False) as conn:
                return await statement.fetch(conn, params)

        return await written(once)

    async def _logged(self, run_id: UUID, rows: list[asyncpg.Record]) -> bool:
        """Whether the run was updated (a batch logged with it, or not if it was already);
        its readers elsewhere woken when it has some."""
        if rows and rows[0]["watched"]:
            await self._notify(f"events:{run_id}")
        return bool(rows)

    async def _notify(self, topic: str) -> None:
        """Wake readers elsewhere, after the statement that made the news (a NOTIFY inside it
        would, on Citus, be sent by the worker that ran it, where no one listens)."""
        with contextlib.suppress(StorageError):  # those woken look again by themselves
            async with driver(self._db.engine, write=False) as conn:
                await sql.NOTIFY.execute(conn, {"topics": [topic]})


class PostgresRunReads:
    def __init__(self, db: Adapter, known: KnownRuns) -> None:
        self._db = db
        self._known = known

    async def read_run(
        self, run_id: UUID, owner: str, conversation_id: UUID | None = None
    ) -> RunView | None:
        params = {**(await self._known.at(run_id, conversation_id)), "owner": owner}
        async with driver(self._db.engine, write=False) as conn:
            row = await sql.READ.fetchrow(conn, params)
        if row is None:
            return None
        self._known.learn(run_id, row["conversation_id"])
        key = await reading_key(self._db.keyring, owner, [row], ["assistant_message", "response"])
        where = turn_place(row["conversation_id"], row["seq"] or 0, "assistant_message")
        message = get(key, where, row["assistant_message"], row["sealed_assistant_message"])
        return view(row, key, message)

    async def run_events(
        self, run_id: UUID, owner: str, after: int
    ) -> tuple[RunView, list[RunEvent]] | None:
        params = {**(await self._known.at(run_id)), "owner": owner, "after": after}
        async with driver(self._db.engine, write=False) as conn:
            rows = await sql.READ_EVENTS.fetch(conn, params)
        if not rows:
            return None
        self._known.learn(run_id, rows[0]["conversation_id"])
        key = await reading_key(self._db.keyring, owner, rows, ["events", "response"])
        return view(rows[0], key), Events(key, run_id).after(rows, after)

    async def find_run(self, conversation_id: UUID, owner: str, base_revision: int) -> UUID | None:
        params = {"cid": conversation_id, "owner": owner, "base": base_revision}
        async with driver(self._db.engine, write=False) as conn:
            found: UUID | None = await sql.RUN_AT.fetchval(conn, params)
        if found is not None:
            self._known.learn(found, conversation_id)
        return found

    async def cancel_requested(self, run_ids: Sequence[UUID]) -> set[UUID]:
        if not run_ids:
            return set()
        params = merged(await self._known.among(run_ids))
        async with driver(self._db.engine, write=False) as conn:  # a read: one statement
            rows = await sql.CANCEL_REQUESTED.fetch(conn, params)
        return {row["id"] for row in rows}
