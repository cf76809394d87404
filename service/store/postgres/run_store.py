"""Durable turns in PostgreSQL: runs and their events (the RunStore port).

Events and a run's progress are written without waiting for a synchronous standby or for
their own WAL flush: they are what a client saw, not what the conversation keeps, and the
commit of the turn (which ends its run, see PostgresStore.append) waits as every commit does.
Readers elsewhere are woken only for runs that have one (``watched``): a NOTIFY takes a global
lock at commit, so it is not sent for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.events import ERROR, RunEvent
from service.core.model import NewRun, Renewed, RunEnd, RunView
from service.platform.crypto import DataKey
from service.store.postgres.keyring import Keyring
from service.store.postgres.listener import CHANNEL
from service.store.postgres.sealed import (
    events_place,
    get,
    put,
    reading_key,
    turn_place,
    writing_key,
)
from service.store.postgres.tx import read, transaction, written

_BATCH = msgspec.json.Decoder(list[tuple[int, str, msgspec.Raw]])

_NO_SYNC_WAIT = "set_config('synchronous_commit', 'off', true)"
_UNFINISHED = "status IN ('queued', 'in_progress')"
_LIVE = "(r.expires_at IS NULL OR r.expires_at > now())"

CREATE = sa.text(
    "INSERT INTO turn_runs (id, conversation_id, owner, background, status, heartbeat_until,"
    " created_at, last_event, cancel_requested, watched)"
    " VALUES (:id, :cid, :owner, :background, 'queued', now() + make_interval(secs => :hb),"
    " now(), 0, false, false)"
)
LOG = sa.text(
    "WITH r AS (UPDATE turn_runs SET last_event = :last,"
    " status = CASE WHEN status = 'queued' THEN 'in_progress' ELSE status END"
    f" WHERE id = :id AND {_UNFINISHED} RETURNING id, watched),"
    " e AS (INSERT INTO turn_events (turn_id, seq, events, sealed_events) SELECT r.id, :last,"
    " CAST(:events AS json), :sealed_events FROM r ON CONFLICT DO NOTHING RETURNING 1)"
    f" SELECT (SELECT count(*) FROM e), CASE WHEN r.watched THEN pg_notify('{CHANNEL}',"
    f" 'events:' || r.id::text) END, {_NO_SYNC_WAIT} FROM r"
)
END = sa.text(
    "WITH r AS (UPDATE turn_runs SET status = :status, error_code = :code,"
    " error_message = :message, last_event = :last, revision = :revision, finished_at = now(),"
    " expires_at = now() + make_interval(secs => :ttl)"
    f" WHERE id = :id AND {_UNFINISHED} RETURNING id, watched),"
    " e AS (INSERT INTO turn_events (turn_id, seq, events, sealed_events) SELECT r.id, :last,"
    " CAST(:events AS json), :sealed_events FROM r ON CONFLICT DO NOTHING RETURNING 1)"
    f" SELECT (SELECT count(*) FROM e), CASE WHEN r.watched THEN pg_notify('{CHANNEL}',"
    f" 'events:' || r.id::text) END, {_NO_SYNC_WAIT} FROM r"
)
# A durable turn's commit ends its run (in the commit's transaction, after the turn row): no
# row means the run was interrupted meanwhile, and the whole commit is rolled back.
COMMIT = sa.text(
    "WITH r AS (UPDATE turn_runs SET status = :status, revision = :revision, last_event = :seq,"
    " finished_at = now(), expires_at = now() + make_interval(secs => :ttl)"
    f" WHERE id = :id AND {_UNFINISHED} RETURNING id, watched)"
    " INSERT INTO turn_events (turn_id, seq, events, sealed_events)"
    " SELECT r.id, :seq, CAST(:events AS json), :sealed_events FROM r"
    " RETURNING (SELECT watched FROM r)"
)
_VIEW = (
    "r.id, r.conversation_id, r.status, r.revision, r.error_code, r.error_message,"
    " r.last_event, r.background, (r.heartbeat_until < now()) AS stalled"
)
READ = sa.text(
    f"SELECT {_VIEW}, t.seq, t.assistant_message, t.sealed_assistant_message"
    " FROM turn_runs r LEFT JOIN turns t"
    " ON t.conversation_id = r.conversation_id AND t.seq = r.revision"
    f" WHERE r.id = :id AND r.owner = :owner AND {_LIVE}"
)
# The batches that hold events after :after (a batch's seq is its last event's).
READ_EVENTS = sa.text(
    f"SELECT {_VIEW}, e.seq, CAST(e.events AS text) AS events, e.sealed_events"
    " FROM turn_runs r LEFT JOIN turn_events e ON e.turn_id = r.id AND e.seq > :after"
    f" WHERE r.id = :id AND r.owner = :owner AND {_LIVE} ORDER BY e.seq"
)
WATCH = sa.text(
    "UPDATE turn_runs SET watched = true WHERE id = :id AND NOT watched"
    f" RETURNING pg_notify('{CHANNEL}', 'watch:' || id::text), {_NO_SYNC_WAIT}"
)
BEGIN = sa.text(
    "UPDATE turn_runs SET status = 'in_progress' WHERE id = :id AND status = 'queued'"
    f" RETURNING {_NO_SYNC_WAIT}"
)
CANCEL = sa.text(
    "WITH r AS (UPDATE turn_runs SET cancel_requested = true"
    f" WHERE id = :id AND owner = :owner AND {_UNFINISHED} RETURNING id)"
    f" SELECT pg_notify('{CHANNEL}', 'cancel:' || id::text) FROM r"
)
RENEW = sa.text(
    "UPDATE turn_runs SET heartbeat_until = now() + make_interval(secs => :hb)"
    f" WHERE id = ANY(CAST(:ids AS uuid[])) AND {_UNFINISHED}"
    f" RETURNING id, cancel_requested, watched, {_NO_SYNC_WAIT}"
)
CANCEL_REQUESTED = sa.text(
    "SELECT id FROM turn_runs WHERE id = ANY(CAST(:ids AS uuid[])) AND cancel_requested"
)
# A stalled run is locked first, so its terminal event can be sealed for its place (the batch
# is named by its event's number) before it is written.
STALLED = sa.text(
    "SELECT last_event + 1 FROM turn_runs"
    f" WHERE id = :id AND {_UNFINISHED} AND heartbeat_until < now() FOR UPDATE"
)
INTERRUPT = sa.text(
    "WITH r AS (UPDATE turn_runs SET status = 'failed', error_code = 'turn_interrupted',"
    " error_message = :message, last_event = :last, finished_at = now(),"
    " expires_at = now() + make_interval(secs => :ttl)"
    " WHERE id = :id RETURNING id, watched),"
    " e AS (INSERT INTO turn_events (turn_id, seq, events, sealed_events)"
    " SELECT id, :last, CAST(:events AS json), :sealed_events FROM r RETURNING 1)"
    f" SELECT (SELECT count(*) FROM e), CASE WHEN r.watched THEN pg_notify('{CHANNEL}',"
    " 'events:' || r.id::text) END FROM r"
)
DELETE_OF = sa.text("DELETE FROM turn_runs WHERE conversation_id = ANY(CAST(:cids AS uuid[]))")
EXPIRED = sa.text("DELETE FROM turn_runs WHERE expires_at < now()")
DELETE_OWNED = sa.text("DELETE FROM turn_runs WHERE owner = :owner")


def batch(events: Sequence[RunEvent]) -> str:
    """The JSON of a batch of events (names are plain words; data is JSON already)."""
    return "[" + ",".join(f'[{e.seq},"{e.name}",{e.data}]' for e in events) + "]"


def sealed_batch(key: DataKey | None, run_id: UUID, events: Sequence[RunEvent]) -> dict[str, Any]:
    """A batch's columns: in clear, or sealed for its run and place."""
    clear, sealed = put(key, events_place(run_id, events[-1].seq), batch(events))
    return {"events": clear, "sealed_events": sealed}


def batch_events(rows: Sequence[Any], key: DataKey | None, after: int) -> list[RunEvent]:
    """The events after ``after`` in these batches, each once (a batch logged twice, its
    first try's outcome unknown, may overlap the next)."""
    found: dict[int, RunEvent] = {}
    for row in rows:
        if row.seq is None:
            continue
        text = get(key, events_place(row.id, row.seq), row.events, row.sealed_events)
        for seq, name, data in _BATCH.decode(text):
            if seq > after:
                found.setdefault(seq, RunEvent(seq, name, bytes(data).decode()))
    return [found[seq] for seq in sorted(found)]


def view(row: Any, message: str | None = None) -> RunView:
    return RunView(
        id=row.id,
        conversation_id=row.conversation_id,
        status=row.status,
        revision=row.revision,
        message=message,
        error_code=row.error_code,
        error_message=row.error_message,
        last_event=row.last_event,
        background=row.background,
        stalled=row.stalled,
    )


class PostgresRuns:
    """The RunStore port over one engine (the commit's part is PostgresStore.append's)."""

    def __init__(
        self, engine: AsyncEngine, *, events_ttl_s: float, keyring: Keyring | None = None
    ) -> None:
        self._engine = engine
        self._ttl_s = events_ttl_s
        self._keyring = keyring  # events are sealed under their owner's key with one

    async def create_run(self, run: NewRun, heartbeat_s: float) -> None:
        params = {
            "id": run.id, "cid": run.conversation_id, "owner": run.owner,
            "background": run.background, "hb": heartbeat_s,
        }  # fmt: skip
        await self._write(CREATE, params)

    async def begin_run(self, run_id: UUID) -> None:
        await self._write(BEGIN, {"id": run_id})

    async def log_events(self, run_id: UUID, owner: str, events: Sequence[RunEvent]) -> None:
        columns = sealed_batch(await writing_key(self._keyring, owner), run_id, events)
        await self._write(LOG, {"id": run_id, "last": events[-1].seq, **columns})

    async def end_run(self, run_id: UUID, owner: str, end: RunEnd) -> bool:
        events = sealed_batch(await writing_key(self._keyring, owner), run_id, end.events)
        params = {
            "id": run_id, "status": end.status, "code": end.error_code,
            "message": end.error_message, "last": end.events[-1].seq, "ttl": self._ttl_s,
            "revision": end.revision, **events,
        }  # fmt: skip
        return bool(await self._write(END, params))

    async def read_run(self, run_id: UUID, owner: str) -> RunView | None:
        async with read(self._engine) as conn:
            row = (await conn.execute(READ, {"id": run_id, "owner": owner})).first()
        if row is None:
            return None
        fields = row._mapping
        key = await reading_key(self._keyring, owner, [fields], ["assistant_message"])
        where = turn_place(row.conversation_id, row.seq or 0, "assistant_message")
        return view(row, get(key, where, row.assistant_message, row.sealed_assistant_message))

    async def run_events(
        self, run_id: UUID, owner: str, after: int
    ) -> tuple[RunView, list[RunEvent]] | None:
        params = {"id": run_id, "owner": owner, "after": after}
        async with read(self._engine) as conn:
            rows = (await conn.execute(READ_EVENTS, params)).all()
        if not rows:
            return None
        fields = [row._mapping for row in rows]
        key = await reading_key(self._keyring, owner, fields, ["events"])
        return view(rows[0]), batch_events(rows, key, after)

    async def watch_run(self, run_id: UUID) -> None:
        await self._write(WATCH, {"id": run_id})

    async def cancel_run(self, run_id: UUID, owner: str) -> bool:
        return bool(await self._write(CANCEL, {"id": run_id, "owner": owner}))

    async def renew_runs(self, run_ids: Sequence[UUID], heartbeat_s: float) -> Renewed:
        async with read(self._engine) as conn:
            rows = (await conn.execute(RENEW, {"ids": list(run_ids), "hb": heartbeat_s})).all()
        return Renewed(
            frozenset(row.id for row in rows if row.cancel_requested),
            frozenset(row.id for row in rows if row.watched),
        )

    async def cancel_requested(self, run_ids: Sequence[UUID]) -> set[UUID]:
        async with read(self._engine) as conn:
            rows = (await conn.execute(CANCEL_REQUESTED, {"ids": list(run_ids)})).all()
        return {row.id for row in rows}

    async def interrupt_run(self, run_id: UUID, owner: str, message: str, event_data: str) -> bool:
        key = await writing_key(self._keyring, owner)

        async def interrupt() -> bool:
            async with transaction(self._engine) as conn:
                last = await conn.scalar(STALLED, {"id": run_id})
                if last is None:
                    return False  # alive, or ended meanwhile
                batch = sealed_batch(key, run_id, [RunEvent(last, ERROR, event_data)])
                params = {"id": run_id, "message": message, "ttl": self._ttl_s, "last": last}
                await conn.execute(INTERRUPT, {**params, **batch})
                return True

        return await written(interrupt)

    async def _write(self, statement: sa.TextClause, params: dict[str, Any]) -> int:
        """One statement (autocommit), retried on a stale read-only session; its rows."""

        async def once() -> int:
            async with read(self._engine) as conn:
                result = await conn.execute(statement, params)
                return len(result.all()) if result.returns_rows else result.rowcount

        return await written(once)
