"""Where a durable turn's run is: the conversation its statements name (run_statements.HERE,
AMONG), so that on Citus each goes to that conversation's worker instead of every shard.

A replica knows the conversation of each run it made or read (``KnownRuns``, in memory). On
Citus, one that never saw a run (behind a load balancer: a status read, an events read, a
cancel) reads it in ``run_homes`` (migration 0023), a plain table on the coordinator
(placement.py): one statement that needs no worker. A run's home is written with the run, in
the same statement (the coordinator's own table and the run's worker: one phase, no two-phase
commit, deploy/SCALE-OUT.md "Each owner's rows"), and deleted with it: a run forgotten, its
conversation deleted or purged, its owner's rows deleted, its events expired. A run without a
home (made by the release before, during a rolling upgrade) is looked for by its id on every
shard, once, by a read; its statements then name its conversation too, so a cancel is never an
UPDATE of every shard.

Plain PostgreSQL finds a run by its id in one index: it neither writes nor reads run_homes, and
its statements and round trips are as they were. Every choice between the two is made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import asyncpg

from migrations.commit_function import CREATE_RUN
from service.store.postgres import run_statements
from service.store.postgres.adapter import Adapter
from service.store.postgres.tx import Compiled, driver, grouped, sql, written

KNOWN_RUNS = 10_000  # runs whose conversation a process remembers
# The conversation a run found nowhere is named by: none has this id (conversations' are
# random), so the run's statements, routed to one shard, find nothing there.
NOWHERE = UUID(int=0)

# A run made with its home (run_statements.CREATE's parameters): the function a CTE of its own
# (statements.ON_COORDINATOR), so it runs on the coordinator and routes its INSERT to the
# conversation's worker, and the home is written by the same statement. (The function's
# synchronous_commit off is then the coordinator's: the worker's commit flushes its WAL.)
CREATE = sql(f"""
    WITH made AS MATERIALIZED (SELECT {CREATE_RUN.call()} AS made), home AS (
        INSERT INTO run_homes (id, conversation_id, owner) SELECT :id, :cid, :owner FROM made
    )
    SELECT made FROM made
""")
HOME = sql("SELECT conversation_id FROM run_homes WHERE id = :id")
HOMES = sql("SELECT id, conversation_id FROM run_homes WHERE id = ANY(CAST(:ids AS uuid[]))")
# A run without a home: looked for on every shard (a read: no two-phase commit).
FOUND = sql("SELECT conversation_id FROM turn_runs WHERE id = :id")
FORGET = sql(f"{run_statements.FORGET_TEXT} RETURNING id")
FORGOTTEN = sql("DELETE FROM run_homes WHERE id = :id")
OF = sql("DELETE FROM run_homes WHERE conversation_id = ANY(CAST(:cids AS uuid[]))")
OWNED = sql("DELETE FROM run_homes WHERE owner = :owner")
# The runs past TURN_EVENTS_TTL_S (a DELETE on every shard, as on plain PostgreSQL) and their
# homes, their ids passed on by the coordinator.
EXPIRED = sql(f"""
    WITH gone AS ({run_statements.EXPIRED_TEXT} RETURNING id)
    DELETE FROM run_homes WHERE id IN (SELECT id FROM gone)
""")


async def creating(db: Adapter) -> Compiled:
    """The statement that makes a run (run_statements.CREATE's parameters): on Citus with its
    home."""
    return CREATE if await db.distributed() else run_statements.CREATE


async def forget(db: Adapter, params: dict[str, Any]) -> None:
    """run_statements.FORGET; on Citus the run's home with it, in one transaction (the
    coordinator's table and the run's worker: one phase)."""

    async def once() -> None:
        if not await db.distributed():
            async with driver(db.engine, write=False) as conn:
                await run_statements.FORGET.execute(conn, params)
            return
        async with driver(db.engine, write=True) as conn:
            if await FORGET.fetch(conn, params):
                await FORGOTTEN.execute(conn, params)

    await written(once)


async def delete_of(db: Adapter, conn: asyncpg.Connection, cids: list[UUID]) -> None:
    """In a deletion's transaction: the runs of the conversations ``cids`` and their events;
    on Citus their homes too."""
    await run_statements.DELETE_OF.execute(conn, {"cids": cids})
    if await db.distributed(conn):
        await OF.execute(conn, {"cids": cids})


async def delete_owned(db: Adapter, conn: asyncpg.Connection, owner: str) -> None:
    """In the deletion of an owner's rows: their runs left; on Citus their homes too."""
    await run_statements.DELETE_OWNED.execute(conn, {"owner": owner})
    if await db.distributed(conn):
        await OWNED.execute(conn, {"owner": owner})


async def delete_expired(db: Adapter, conn: asyncpg.Connection) -> None:
    """The runs past TURN_EVENTS_TTL_S; on Citus their homes too (one statement)."""
    expired = EXPIRED if await db.distributed(conn) else run_statements.EXPIRED
    await expired.execute(conn, {})


class KnownRuns:
    """The conversation of each run this process made or read, so that its statements name it
    too (see run_statements.HERE); bounded, the oldest forgotten first. On Citus one not known
    is read in its home."""

    def __init__(self, db: Adapter) -> None:
        self._db = db
        self._conversations: dict[UUID, UUID] = {}

    def learn(self, run_id: UUID, conversation_id: UUID) -> None:
        self._conversations[run_id] = conversation_id
        if len(self._conversations) > KNOWN_RUNS:
            del self._conversations[next(iter(self._conversations))]

    async def at(self, run_id: UUID, conversation_id: UUID | None = None) -> dict[str, Any]:
        """The run's id, and its conversation's: ``conversation_id`` when the caller knows it
        (then a run of another conversation is not found); else None on plain PostgreSQL when
        not known (found by the id alone), on Citus read in its home (NOWHERE: no such run)."""
        cid = conversation_id or self._conversations.get(run_id)
        if cid is not None or not await self._db.distributed():
            return {"id": run_id, "cid": cid}
        async with driver(self._db.engine, write=False) as conn:
            cid = await HOME.fetchval(conn, {"id": run_id})
            if cid is None:  # a run of the release before, or none
                cid = await FOUND.fetchval(conn, {"id": run_id})
        if cid is None:
            return {"id": run_id, "cid": NOWHERE}
        self.learn(run_id, cid)
        return {"id": run_id, "cid": cid}

    async def among(self, run_ids: Sequence[UUID]) -> list[dict[str, Any]]:
        """The runs' ids by conversation, each with its conversation's (``cids``, one; None
        for those not known, on Citus not in their homes either: found by their ids alone)."""
        unknown = [run_id for run_id in run_ids if run_id not in self._conversations]
        if unknown and await self._db.distributed():
            async with driver(self._db.engine, write=False) as conn:
                for row in await HOMES.fetch(conn, {"ids": unknown}):
                    self.learn(row["id"], row["conversation_id"])
        by_conversation = grouped((self._conversations.get(run_id), run_id) for run_id in run_ids)
        return [
            {"ids": ids, "cids": None if cid is None else [cid]}
            for cid, ids in by_conversation.items()
        ]
