"""A turn's commit in PostgreSQL (History.append): the commit statement (statements.COMMIT),
conditional on the revision the turn read; a turn that makes its fork or ends its run does those
in the same transaction, a plain one is that statement alone (the turn's search terms join its
conversation's in it: migration 0021)."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    StorageError,
    TurnInterrupted,
)
from service.core.model import Append, Commit, RunCommit
from service.platform.crypto import DataKey
from service.store.postgres import forks, run_statements, terms
from service.store.postgres.adapter import Adapter
from service.store.postgres.rows import Events, Rows
from service.store.postgres.tx import Params, driver


async def commit(db: Adapter, append: Append, codec: Rows) -> Commit:
    """The commit's transaction (the run's end rolls it all back if the run was interrupted
    meanwhile); the lease it released and the run's events woken once committed."""
    cid, expected, run = append.conversation_id, append.expected_revision, append.run
    revision = expected + 1  # the commit's, if it happens (the turn's place for sealing)
    params = {
        **codec.turn_columns(revision, append.turn, run.run_id if run else None),
        "cid": cid,
        "expected": expected,
        "context_start": append.turn.context_from,
        "caller": append.owner,
        "holder": append.lease,
        "idle_s": db.sql.idle_s,
        "ttl_s": db.config.idempotency_ttl_s,
        "idem_key": append.idempotency.key if append.idempotency else None,
        "claim": append.idempotency.claim if append.idempotency else None,
        "expires_at": _expiry(db, append),
        "stored_bytes": append.stored_bytes,
        **terms.of_turn(codec.key, append.turn),
    }
    wake: list[str] = []  # topics to notify once committed
    folded = await db.places.folded()
    # One statement (a function, on Citus sent whole to the conversation's worker; with an
    # Idempotency-Key run on the coordinator, where the key is, its statements on the
    # conversation routed to that worker: statements.ON_COORDINATOR), unless the turn makes
    # its fork: a transaction then, over the source's group and the fork's.
    one = append.fork_of is None
    if one and run is not None:
        params.update(_run_end(db, run, revision, codec.key))
    async with driver(db.engine, write=not one) as conn:
        if append.fork_of is not None:
            fork = {
                "src": append.fork_of.source,
                "at": append.fork_of.revision,
                "caller": append.owner,
                "new": cid,
            }
            if await forks.copy(db, conn, fork, codec.key, counted=False) is None:
                raise await forks.why_not(db, conn, fork)  # the source went meanwhile
        ended = run is not None and one  # the commit ends the run
        if folded or append.idempotency is None:
            statement = (db.sql.commit_run if ended else db.sql.commit)[folded]
        else:  # on Citus, where the key is: the coordinator
            statement = db.sql.commit_run_keyed if ended else db.sql.commit_keyed
        row = await statement.fetchrow(conn, params)
        if row is None:
            raise await _why_not(db, conn, params)
        if row["lease_wanted"]:  # turns wait for the lease this commit released
            wake.append(f"lease:{cid}")
        if run is not None and one and row["watched"]:
            wake.append(f"events:{run.run_id}")  # its events are followed elsewhere
        if run is not None and not one and await _end_run(db, conn, cid, run, revision, codec.key):
            wake.append(f"events:{run.run_id}")
    if append.lease is not None and await db.places.apart():  # on the coordinator
        with contextlib.suppress(StorageError):  # it stops counting at its ``until``
            await db.places.free(append.owner, append.lease)
    if wake:
        await db.wake(wake)
    return Commit(row["revision"], row["created_at"], row["updated_at"])


def _expiry(db: Adapter, append: Append) -> datetime | None:
    """When a stored response's conversation goes, should this commit make or continue one
    (the commit statement keeps NULL for every other)."""
    if append.stored_response or append.expected_revision > 0 or append.fork_of:
        return datetime.now(UTC) + timedelta(seconds=db.config.stored_response_ttl_s)
    return None


def _run_end(db: Adapter, run: RunCommit, revision: int, key: DataKey | None) -> Params:
    """The run's end as COMMIT_RUN takes it, with its message.done at ``revision``."""
    batch = Events(key, run.run_id).batch_columns([run.done.event(run.done_seq, revision)])
    return {
        "run": run.run_id,
        "run_status": run.status,
        "done_seq": run.done_seq,
        "events_ttl_s": db.config.events_ttl_s,
        **batch,
    }


async def _end_run(
    db: Adapter,
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
    ended = await run_statements.COMMIT.fetchrow(
        conn,
        {
            "id": run.run_id,
            "cid": cid,
            "status": run.status,
            "revision": revision,
            "seq": run.done_seq,
            "ttl": db.config.events_ttl_s,
            **batch,
        },
    )
    if ended is None:
        raise TurnInterrupted()
    return bool(ended[0])


async def _why_not(db: Adapter, conn: asyncpg.Connection, params: Params) -> Exception:
    if params["expected"] == 0:
        return ConversationConflict()
    exists = await db.sql.exists.fetchval(conn, params)
    return ConversationConflict() if exists else ConversationNotFound()
