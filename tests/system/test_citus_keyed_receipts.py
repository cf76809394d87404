"""An Idempotency-Key commits once on Citus although its write and its key commit in one phase
over two servers (deploy/SCALE-OUT.md, "Each owner's rows"; service/store/postgres/receipts.py).

The coordinator's crash between its worker's COMMIT and its own is made once for real (the
worker's COMMIT held by a trigger while the coordinator's backend is killed); the lost
acknowledgement of the worker's COMMIT cannot be, so the other tests make the state either
leaves: the write and its receipt committed on the worker, the key on the coordinator
still running with its lease run out (the coordinator crashed) or lapsed at once (the attempt
got storage_error and let its claim go). A retry with the key then answers what the first
attempt did and calls no provider (before receipts it ran the turn again: a second turn). A
claim in doubt with no receipt (its attempt never committed) is claimed afresh: the retry runs
once. With the receipt's worker down a retry answers storage_error, never a second write."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import asyncpg
import pytest

from service.core.model import IdempotencyKey, Removal
from service.platform import migrate
from service.platform.db import create_engine
from service.store.postgres import PostgresStore
from service.store.postgres.placement import distribute
from tests.support.citus import (
    CitusCluster,
    citus_cluster,
    citus_database,
    require_citus,
    restarted,
    stop,
)
from tests.support.database import asyncpg_dsn, connected
from tests.support.fakeapi import Script
from tests.support.helpers import CHAT
from tests.support.turn_kinds import replica

pytestmark = pytest.mark.citus
CONVERSATIONS = "/api/v1/conversations"

WHERE = (
    "SELECT nodeport FROM citus_shards"
    " WHERE shardid = get_shard_id_for_distribution_column('conversations', $1::text)"
)
# The shard of the turns that holds a conversation's, and its worker.
SHARD = """
    SELECT shard_name('turns', shardid) AS shard_name, nodeport
    FROM citus_shards
    WHERE shardid = get_shard_id_for_distribution_column('turns', $1::text)
"""
# On that worker: its COMMIT of a turn held for a while (a deferred trigger runs in it).
HELD_COMMIT = """
    SET citus.enable_manual_changes_to_shards = on;
    SET citus.enable_ddl_propagation = off;
    CREATE OR REPLACE FUNCTION held_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN PERFORM pg_sleep(6); RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER held AFTER INSERT ON {shard} DEFERRABLE INITIALLY DEFERRED
        FOR EACH ROW EXECUTE FUNCTION held_commit();
"""
KEPT = "SELECT count(*) FROM idempotency_keys WHERE key = $1"
IN_COMMIT = "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep')"
# On the coordinator: the backend of the keyed commit, waiting for that worker.
COMMITTING = """
    SELECT pid FROM pg_stat_activity
    WHERE query LIKE '%turnstore_commit%' AND pid <> pg_backend_pid()
"""
# The coordinator crashed after its worker committed: the key still running, its lease run out.
CRASHED = """
    UPDATE idempotency_keys SET state = 'running', conversation_id = NULL, revision = NULL,
        expires_at = now() - interval '1 second'
    WHERE key = $1
"""
# The worker's acknowledgement was lost: the key's completion rolled back, and the attempt,
# answered storage_error, let its claim go.
LOST_ACK = """
    UPDATE idempotency_keys SET state = 'running', conversation_id = NULL, revision = NULL,
        expires_at = '-infinity'
    WHERE key = $1
"""


async def test_a_retry_of_a_write_in_doubt_answers_what_it_committed(database: str) -> None:
    async with replica(database, 0.0) as r, connected(database) as db:
        prepared = await _two_phase(db)
        # A new conversation's first turn, its coordinator crashed after the worker committed.
        r.api.then(Script(text="first answer"))
        key = {"Idempotency-Key": "made-in-doubt"}
        first = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        await db.execute(CRASHED, "made-in-doubt")
        r.api.then(Script(text="second answer"))  # what a second run would get
        again = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
        assert again.status_code == 200, again.text
        assert _answer(again.json()) == _answer(first.json())
        assert len(r.api.requests) == 1  # the provider was not called again
        assert await _revision(db, cid) == 1  # one turn
        assert await _state(db, "made-in-doubt") == ("done", 1)

        # A turn on it, its worker's acknowledgement lost.
        r.api.anew(Script(text="third answer"))
        key = {"Idempotency-Key": "turn-in-doubt"}
        body = {"message": "again", "conversation_id": cid}
        first = await r.client.post(CHAT, json=body, headers=key)
        assert first.status_code == 200, first.text
        await db.execute(LOST_ACK, "turn-in-doubt")
        r.api.then(Script(text="fourth answer"))
        again = await r.client.post(CHAT, json=body, headers=key)
        assert again.status_code == 200, again.text
        assert _answer(again.json()) == _answer(first.json())
        assert len(r.api.requests) == 1
        assert await _revision(db, cid) == 2
        # Another request with that key is still refused as one (the receipt settled it).
        other = await r.client.post(CHAT, json={**body, "message": "other"}, headers=key)
        assert other.status_code == 422, other.text

        assert await _two_phase(db) == prepared  # each write and each retry on one worker

        # A fork (a new conversation, its id fixed with the claim) and a deletion, each in
        # doubt: replayed, not done twice. (A fork copies from its source's worker to its own:
        # its two-phase commits are its own, with or without a key.)
        key = {"Idempotency-Key": "fork-in-doubt"}
        first = await r.client.post(
            f"{CONVERSATIONS}/{cid}/fork", json={"at_revision": 1}, headers=key
        )
        assert first.status_code == 201, first.text
        await db.execute(CRASHED, "fork-in-doubt")
        again = await r.client.post(
            f"{CONVERSATIONS}/{cid}/fork", json={"at_revision": 1}, headers=key
        )
        assert again.status_code == 201, again.text
        assert _answer(again.json()) == _answer(first.json())
        forks = "SELECT count(*) FROM conversations WHERE forked_from = $1::uuid"
        assert await db.fetchval(forks, cid) == 1
        prepared = await _two_phase(db)
        key = {"Idempotency-Key": "delete-in-doubt"}
        gone = await r.client.delete(f"{CONVERSATIONS}/{cid}", headers=key)
        assert gone.status_code == 204, gone.text
        await db.execute(LOST_ACK, "delete-in-doubt")
        again = await r.client.delete(f"{CONVERSATIONS}/{cid}", headers=key)
        assert again.status_code == 204, again.text  # not 404: its receipt says it deleted
        assert len(r.api.requests) == 1

        # The receipts were written on the conversation's worker with each key's claim; those of
        # the deleted conversation went with it, but for the deletion's own (until its TTL).
        left = "SELECT revision FROM idempotency_receipts WHERE conversation_id = $1::uuid"
        assert [row["revision"] for row in await db.fetch(left, cid)] == [None]
        assert await _two_phase(db) == prepared


async def test_a_key_whose_write_failed_before_its_commit_is_freed(database: str) -> None:
    """Not in doubt (the provider failed: nothing was committed anywhere): the key is freed
    at once, as on plain PostgreSQL, and its retry needs no receipt (so no worker of the
    conversation the first attempt would have made)."""
    async with replica(database, 0.0) as r, connected(database) as db:
        key = {"Idempotency-Key": "failed-early"}
        r.api.then(Script(http_status=500))
        first = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
        assert first.status_code == 502, first.text
        assert await db.fetchval(KEPT, "failed-early") == 0
        r.api.then(Script(text="now"))
        again = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
        assert again.status_code == 200, again.text
        assert await db.fetchval("SELECT count(*) FROM idempotency_receipts WHERE fence") == 0


async def test_a_claim_in_doubt_without_a_receipt_runs_once(database: str) -> None:
    async with replica(database, 0.0) as r, connected(database) as db:
        made = await r.client.post(CHAT, json={"message": "hello"})
        assert made.status_code == 200, made.text
        cid = made.json()["conversation_id"]
        # The first attempt fails before its commit (its provider refused it): not in doubt,
        # its key is freed at once.
        r.api.anew(Script(http_status=400, error_code="invalid_request_error"))
        key = {"Idempotency-Key": "never-committed"}
        body = {"message": "again", "conversation_id": cid}
        failed = await r.client.post(CHAT, json=body, headers=key)
        assert failed.status_code >= 400, failed.text
        assert await db.fetchval(KEPT, "never-committed") == 0
        r.api.then(Script(text="ran once"))
        ran = await r.client.post(CHAT, json=body, headers=key)
        assert ran.status_code == 200, ran.text
        assert len(r.api.requests) == 2
        assert await _revision(db, cid) == 2
        again = await r.client.post(CHAT, json=body, headers=key)  # now done: replayed
        assert _answer(again.json()) == _answer(ran.json())
        assert len(r.api.requests) == 2
        # In doubt after its lease ran out, with no receipt: claimed afresh, runs once.
        await db.execute(CRASHED, "never-committed")
        await db.execute("DELETE FROM idempotency_receipts")
        r.api.then(Script(text="ran again"))
        rerun = await r.client.post(CHAT, json=body, headers=key)
        assert rerun.status_code == 200, rerun.text
        assert len(r.api.requests) == 3
        assert await _revision(db, cid) == 3


def test_a_claim_in_doubt_with_its_worker_down_is_a_storage_error() -> None:
    """The receipt cannot be read: the retry answers storage_error and calls no provider;
    once the worker is back it replays."""
    require_citus()
    with citus_cluster() as cluster, ExitStack() as later, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        key = {"Idempotency-Key": "worker-down"}

        async def down() -> tuple[int, dict[str, Any]]:
            async with replica(url, 0.0) as r, connected(url) as db:
                r.api.then(Script(text="first"))
                first = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
                assert first.status_code == 200, first.text
                port = await db.fetchval(WHERE, first.json()["conversation_id"])
                await db.execute(CRASHED, "worker-down")
                stop(next(w for w in cluster.workers if w.port == port))
                r.api.then(Script(text="second"))
                retry = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
                assert retry.status_code == 500, retry.text
                assert retry.json()["error"]["code"] == "storage_error", retry.text
                assert len(r.api.requests) == 1
                return int(port), dict(first.json())

        port, first = asyncio.run(down())
        later.enter_context(restarted(next(w for w in cluster.workers if w.port == port)))

        async def back() -> None:
            async with replica(url, 0.0) as r:
                r.api.then(Script(text="third"))
                again = await r.client.post(CHAT, json={"message": "hello"}, headers=key)
                assert again.status_code == 200, again.text
                assert _answer(again.json()) == _answer(first)
                assert not r.api.requests

        asyncio.run(back())


def test_the_coordinator_crashed_after_its_worker_committed() -> None:
    """The crash itself, not its state: the worker's COMMIT of a keyed turn held (a deferred
    trigger on the turns' shard sleeps in it), and meanwhile the coordinator's backend that
    waits for it killed (the postmaster then restarts the coordinator's sessions, as after any
    crash). The worker commits the turn and its receipt; the coordinator's part, the key's
    completion, never commits: the client gets storage_error, the key stays running. Once its
    lease has run out a retry replays the turn the worker kept: one turn, one provider call.
    The retry comes while the worker still commits (its receipt not visible yet): its fence
    waits for that commit. (Before receipts the retry ran the turn again; before the fence,
    with no receipt to read yet, too.)"""
    require_citus()
    with citus_cluster() as cluster, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        asyncio.run(_crashed(url, cluster))


async def _crashed(url: str, cluster: CitusCluster) -> None:
    key = {"Idempotency-Key": "coordinator-crashed"}
    async with replica(url, 0.0) as r:
        async with connected(url) as db:
            made = await r.client.post(CHAT, json={"message": "hello"})
            assert made.status_code == 200, made.text
            cid = made.json()["conversation_id"]
            shard = await db.fetchrow(SHARD, cid)
            worker = next(w for w in cluster.workers if w.port == shard["nodeport"])
            on_worker = await asyncpg.connect(worker.dsn(url.rsplit("/", 1)[1]))
            try:
                await on_worker.execute(HELD_COMMIT.format(shard=shard["shard_name"]))
                r.api.then(Script(text="kept by the worker"))
                body = {"message": "again", "conversation_id": cid}
                turn = asyncio.create_task(r.client.post(CHAT, json=body, headers=key))
                await _until(on_worker, IN_COMMIT)  # the worker in its COMMIT
                os.kill(await db.fetchval(COMMITTING), signal.SIGKILL)
                failed = await turn
                assert failed.status_code == 500, failed.text
                assert failed.json()["error"]["code"] == "storage_error", failed.text
                async with _back(url) as db:  # the coordinator's part lost: the key running
                    assert await _state(db, "coordinator-crashed") == ("running", None)
                assert len(r.api.requests) == 2
                r.api.then(Script(text="a second turn"))
                deadline = asyncio.get_running_loop().time() + 30
                # Retried as a client does: a 409 until the claim's lease (TURN_LEASE_S, 1 s)
                # has run out, a 500 storage_error on a session of the pool the crash closed.
                while True:
                    committing = await on_worker.fetchval(IN_COMMIT)
                    again = await r.client.post(CHAT, json=body, headers=key)
                    if again.status_code not in (409, 500):
                        break
                    assert asyncio.get_running_loop().time() < deadline, again.text
                    await asyncio.sleep(0.2)
                assert committing  # the retry that went through began while it committed
                await _until(on_worker, f"SELECT NOT ({IN_COMMIT})")
                await on_worker.execute(f"DROP TRIGGER held ON {shard['shard_name']}")
                kept = f"SELECT max(seq) FROM {shard['shard_name']} WHERE conversation_id = $1"
                assert await on_worker.fetchval(kept, uuid.UUID(cid)) == 2  # the worker's
            finally:
                await on_worker.close()
        assert again.status_code == 200, again.text
        assert again.json()["revision"] == 2
        assert again.json()["message"] == "kept by the worker"
        assert len(r.api.requests) == 2  # the provider was not called again
        async with connected(url) as db:
            assert await _revision(db, cid) == 2  # one turn
            assert await _state(db, "coordinator-crashed") == ("done", 2)


@asynccontextmanager
async def _back(url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the coordinator once it accepts them again (at most 20 s)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        try:
            conn = await asyncpg.connect(asyncpg_dsn(url))
            break
        except (OSError, asyncpg.PostgresError):
            assert asyncio.get_running_loop().time() < deadline, "the coordinator is not back"
            await asyncio.sleep(0.1)
    try:
        yield conn
    finally:
        await conn.close()


async def _until(conn: asyncpg.Connection, query: str) -> None:
    """Until ``query`` is true (at most 20 s)."""
    deadline = asyncio.get_running_loop().time() + 20
    while not await conn.fetchval(query):
        assert asyncio.get_running_loop().time() < deadline, query
        await asyncio.sleep(0.05)


async def test_receipts_go_with_their_conversation_or_their_ttl(database: str) -> None:
    """Deleted with their conversation (deleted, purged, its owner's rows deleted as a shred
    does), or past their key's TTL (``turnstore purge``); a deletion's own receipt until then."""
    engine = create_engine(database, pool_size=2)
    store = PostgresStore.over(engine)
    try:
        async with connected(database) as db:

            async def made(owner: str = "alice") -> uuid.UUID:
                key = IdempotencyKey.of(owner, f"k-{uuid.uuid4()}", "create").making()
                assert await store.idempotency.claim(key) is None
                info = await store.edits.create_conversation(owner, {}, None, key)
                assert info.id == key.conversation  # made where its claim said
                return info.id

            async def receipts(cid: uuid.UUID | None = None) -> int:
                where = "true" if cid is None else "conversation_id = $1"
                query = f"SELECT count(*) FROM idempotency_receipts WHERE {where}"
                return int(await db.fetchval(query, *([] if cid is None else [cid])))

            cid = await made()
            assert await receipts(cid) == 1
            deletion = IdempotencyKey.of("alice", "delete", "delete").writing(cid)
            assert await store.idempotency.claim(deletion) is None
            await store.history.delete(Removal(cid, "alice", deletion))
            assert await receipts(cid) == 1  # the deletion's own, not the making's
            await db.execute("UPDATE idempotency_receipts SET expires_at = now() - interval '1s'")
            await store.ops.purge()
            assert await receipts() == 0
            cid = await made()
            await db.execute(
                "UPDATE conversations SET expires_at = now() - interval '1s' WHERE id = $1", cid
            )
            await store.ops.purge()
            assert await receipts() == 0
            await made("bob")
            await made("bob")
            assert await receipts() == 2
            await store.owners.delete_owner("bob")
            assert await receipts() == 0
            assert await store.owners.owner_rows("bob") == 0
    finally:
        await engine.dispose()


async def _revision(db: asyncpg.Connection, cid: str) -> Any:
    return await db.fetchval("SELECT revision FROM conversations WHERE id = $1::uuid", cid)


async def _state(db: asyncpg.Connection, key: str) -> tuple[Any, Any]:
    row = await db.fetchrow("SELECT state, revision FROM idempotency_keys WHERE key = $1", key)
    assert row is not None
    return row["state"], row["revision"]


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    """A turn's answer, but for the request's own correlation id."""
    return {name: value for name, value in body.items() if name != "correlation_id"}


async def _two_phase(db: asyncpg.Connection) -> int:
    """Two-phase commits the coordinator made (the test cluster never recovers them)."""
    return int(await db.fetchval("SELECT count(*) FROM pg_dist_transaction"))
