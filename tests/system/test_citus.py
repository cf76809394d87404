"""turnstore on Citus (deploy/SCALE-OUT.md): the store contract, the run store's, the lease,
durable-turn, owner, Idempotency-Key and retention tests run again, unchanged, against the local Citus cluster (tests/support/citus.py:
a coordinator and two workers, migrated with `turnstore db upgrade` and placed with `turnstore
db distribute`). Where Citus is not installed they skip with one line (in CI they fail).

The tests are the other modules' own, imported here: this module only hands them the
cluster's database instead of plain PostgreSQL's. It is marked ``citus``, and tests/conftest.py's
``database_url``, ``database`` and ``engine`` then give the cluster's; the contract suites run
over ``BACKENDS``. Tables are emptied between tests, as on plain PostgreSQL.
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from pathlib import Path

import asyncpg
import msgspec
import pytest
from httpx_sse import aconnect_sse
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core import events as run_events
from service.core.model import Append, NewRun, Turn
from service.platform.db import create_engine
from service.store.postgres import PostgresStore, StoreConfig
from service.store.postgres.encrypting import ClearRows
from tests.integration.test_durable import *  # noqa: F403
from tests.integration.test_leases import *  # noqa: F403
from tests.integration.test_owners_idempotency_retention import *  # noqa: F403
from tests.integration.test_run_begins_with_its_lease import *  # noqa: F403
from tests.integration.test_run_store import *  # noqa: F403
from tests.integration.test_store import *  # noqa: F403
from tests.support.backends import keyring_for
from tests.support.cluster import replicas
from tests.support.database import asyncpg_dsn
from tests.support.events import (
    STREAM,
    TURNS,
    WORDS,
    background,
    event_of,
    follow,
    revision,
    status_becomes,
    text_of,
)
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, start
from tests.system.test_durable_replicas import *  # noqa: F403
from tests.system.test_leases_replicas import *  # noqa: F403

pytestmark = pytest.mark.citus
BACKENDS = ("citus", "citus-encrypted")


# --- two replicas over HTTP ------------------------------------------------------------------


async def test_two_replicas_serve_every_kind_of_turn_on_citus_encrypted(
    database: str, tmp_path: Path
) -> None:
    """A client's day on two replicas of the same Citus database, with encryption at rest:
    plain, streamed and background turns (resumed and cancelled on the other replica), /v1
    conversations and stored responses chained across replicas, a fork, a delete, a purge,
    and nothing left in clear."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"k1:{base64.b64encode(os.urandom(32)).decode()}\n")
    api = FakeResponsesAPI()
    async with replicas(database, tmp_path, api, ENCRYPTION_KEYS_FILE=str(keys)) as (a, b):
        cid = await start(a)  # a plain turn, new conversation
        plain = await b.post(CHAT, json={"message": "plain", "conversation_id": cid})
        assert plain.status_code == 200 and plain.json()["revision"] == 2, plain.text

        api.then(Script(text="".join(WORDS), deltas=len(WORDS), drip_s=0.02))
        body = {"message": "streamed", "conversation_id": cid, "background": True}
        async with aconnect_sse(a, "POST", STREAM, json=body) as source:
            turn_id = source.response.headers["X-Turn-Id"]
            seen = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert seen[-1].name == "message.done" and text_of(seen) == "".join(WORDS)
        resumed = await follow(b, turn_id, last_event_id=2)  # resumed on the other replica
        assert [e.id for e in resumed] == [e.id for e in seen[2:]]

        stall = asyncio.Event()
        stalled = Script(text="never finished", deltas=4, stall=stall)
        api.then(stalled)
        accepted = await background(a, message="stop me", conversation_id=cid)
        await stalled.started.wait()
        cancelled = await b.post(f"{TURNS}/{accepted['turn_id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert (await status_becomes(a, accepted["turn_id"], "cancelled"))["revision"] is None
        stall.set()
        assert await revision(b, cid) == 3

        fork = await b.post(f"/api/v1/conversations/{cid}/fork", json={"at_revision": 2})
        assert fork.status_code == 201, fork.text
        forked = fork.json()["conversation_id"]
        moved_on = await a.post(CHAT, json={"message": "fork", "conversation_id": forked})
        assert moved_on.status_code == 200 and moved_on.json()["revision"] == 3, moved_on.text

        conversation = (await a.post("/v1/conversations", json={})).json()["id"]
        first = await a.post("/v1/responses", json={"conversation": conversation, "input": "hi"})
        assert first.status_code == 200, first.text
        chained = await b.post(
            "/v1/responses", json={"previous_response_id": first.json()["id"], "input": "more"}
        )
        assert chained.status_code == 200, chained.text
        got = await a.get(f"/v1/responses/{chained.json()['id']}")
        assert got.status_code == 200 and got.json()["status"] == "completed", got.text
        items = await b.get(f"/v1/conversations/{conversation}/items")
        # both turns' items (input, reasoning, message): the chained one went on the same
        assert items.status_code == 200 and len(items.json()["data"]) == 6, items.text

        deleted = await b.delete(f"/api/v1/conversations/{forked}")
        assert deleted.status_code == 204, deleted.text
        assert (await a.get(f"/api/v1/conversations/{forked}")).status_code == 404

    clear = await _count(database, "SELECT count(*) FROM turns WHERE sealed_replay_items IS NULL")
    assert clear == 0
    await _expire_all(database)
    purged = await _purge(database)
    # the chat conversation and the /v1 one (the fork was deleted)
    assert purged == 2 and await _count(database, "SELECT count(*) FROM conversations") == 0


async def _count(url: str, query: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return int(await conn.fetchval(query))
    finally:
        await conn.close()


async def _expire_all(url: str) -> None:
    """Every conversation idle for a year (what RETENTION_DAYS=1 purges)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute("UPDATE conversations SET updated_at = now() - interval '365 days'")
    finally:
        await conn.close()


async def _purge(url: str) -> int:
    engine = create_engine(url, pool_size=2)
    try:
        return await PostgresStore.over(engine, StoreConfig(retention_days=1)).ops.purge(batch=2)
    finally:
        await engine.dispose()


async def test_encrypt_existing_seals_every_clear_row_on_citus(engine: AsyncEngine) -> None:
    """`turnstore encrypt-existing` on the cluster: turns, metadata and events written in
    clear are sealed (picked without a lock on every shard, each sealed if still clear), and
    read back the same through an encrypting store."""
    clear = PostgresStore.over(engine)
    turn = Turn("said in clear", "told in clear", [msgspec.Raw(b'{"type":"message"}')])
    cids = [uuid.uuid4() for _ in range(5)]
    for cid in cids:
        await clear.history.append(Append(cid, turn, 0, owner="alice"))
    info = await clear.edits.create_conversation("alice", {"topic": "in clear"})
    runs = PostgresStore.over(engine, StoreConfig(events_ttl_s=60)).run_writes
    run = NewRun(uuid.uuid4(), cids[0], "alice", True)
    await runs.create_run(run, 30)
    await runs.log_events(run.id, "alice", [run_events.delta(1, "streamed in clear")])
    keyring = keyring_for(engine, "citus-encrypted")
    assert keyring is not None
    rows = ClearRows(engine, keyring)
    # 5 turns, the words of their 5 conversations' search terms, the metadata, the events.
    assert await rows.count() == 5 + 5 + 1 + 1
    while await rows.encrypt_batch(2):
        pass
    assert await rows.count() == 0
    sealed = PostgresStore.over(engine, keyring=keyring)
    for cid in cids:
        loaded = await sealed.history.load(cid, "alice")
        assert loaded is not None and loaded.turns[0].user_message == "said in clear"
    described = await sealed.reads.describe(info.id, "alice")
    assert described is not None and described.metadata == {"topic": "in clear"}
    found = await sealed.run_reads.run_events(run.id, "alice", 0)
    assert found is not None and "streamed in clear" in str(found[1][0].data)
