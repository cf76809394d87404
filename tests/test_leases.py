"""Turn leases ("11. Turn leases"): two turns of one conversation meet the same way on every
replica. Real `turnstore serve` processes on one database, the fake Responses API over
loopback HTTP (so this process sees, and can hold back, every provider call); the renewal
failure through a store seam in an in-process app."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app, postgres_backend
from service.platform import migrate
from service.platform.settings import Settings
from service.store.postgres import Adapter, PostgresStore
from service.store.postgres.places import PostgresPlaces
from service.store.postgres.tx import sql
from service.usecases.leases import RELEASE_RETRY_S
from tests.cluster import fake_api, provider_env, replica, replicas, turnstore_env, wait_ready
from tests.database import fresh_database
from tests.fakeapi import FakeResponsesAPI, Script, output_items
from tests.helpers import CHAT, assert_error, failing_renewals, serve, start, until_lease_expired

FAST_S = 0.1  # "at once": a refusal comes back within this


@pytest.fixture
def database(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        yield url


def turn(client: httpx.AsyncClient, cid: str, message: str) -> asyncio.Task[httpx.Response]:
    body = {"message": message, "conversation_id": cid}
    return asyncio.ensure_future(client.post(CHAT, json=body))


@pytest.mark.parametrize("where", ["two replicas", "one replica"])
async def test_with_reject_a_second_turn_is_busy_at_once_and_costs_no_provider_call(
    database: str, tmp_path: Path, where: str
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    async with replicas(database, tmp_path, api, TURN_CONCURRENCY="reject") as (a, b):
        other = b if where == "two replicas" else a
        cid = await start(a)
        slow = Script(gate=gate)
        api.then(slow)
        running = turn(a, cid, "slow")
        await slow.started.wait()
        asked = time.monotonic()
        busy = await other.post(CHAT, json={"message": "second", "conversation_id": cid})
        answered = time.monotonic() - asked
        assert_error(busy, 409, "conversation_busy")
        assert answered < FAST_S, answered
        assert len(api.requests) == 2  # the first turn, and the slow one: not the refused one
        gate.set()
        assert (await running).json()["revision"] == 2


@pytest.mark.parametrize("where", ["two replicas", "one replica"])
async def test_with_queue_a_second_turn_waits_and_runs_on_top_of_the_first(
    database: str, tmp_path: Path, where: str
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    async with replicas(database, tmp_path, api) as (a, b):
        other = b if where == "two replicas" else a
        cid = await start(a)
        slow = Script(gate=gate)
        api.then(slow)
        running = turn(a, cid, "slow")
        await slow.started.wait()
        queued = turn(other, cid, "queued")
        await until_waiting(other, 2 if other is a else 1)  # the slow one holds: it waits
        assert len(api.requests) == 2  # and the provider has not been asked
        gate.set()
        first, second = await running, await queued
        assert (first.status_code, second.status_code) == (200, 200), second.text
        assert (first.json()["revision"], second.json()["revision"]) == (2, 3)
    # The queued turn's request carried the slow turn's items verbatim, as stored.
    slow_items = [*api.requests[1]["input"], *output_items(2, "reply 2", reasoning=True)]
    assert api.requests[2]["input"] == [*slow_items, api.requests[2]["input"][-1]]


async def until_waiting(client: httpx.AsyncClient, in_flight: int) -> None:
    """Until the replica has one turn waiting for a lease (``in_flight``: its requests now)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = (await client.get("/metrics")).text
        if "turnstore_turns_waiting 1.0" in metrics:
            return
        assert time.monotonic() < deadline, f"no turn waits ({in_flight} in flight)"
        await asyncio.sleep(0.02)


async def test_a_killed_replicas_lease_blocks_its_conversation_for_at_most_turn_lease_s(
    database: str, tmp_path: Path
) -> None:
    lease_s = 2.0
    api = FakeResponsesAPI()
    async with fake_api(api) as base_url:
        env = turnstore_env(
            DATABASE_URL=database, TURN_LEASE_S=str(lease_s), **provider_env(base_url)
        )
        with (
            replica(env, tmp_path / "doomed.log") as doomed,
            replica(env, tmp_path / "survivor.log") as survivor,
        ):
            await asyncio.gather(wait_ready(doomed), wait_ready(survivor))
            async with (
                httpx.AsyncClient(base_url=doomed.url, timeout=60) as a,
                httpx.AsyncClient(base_url=survivor.url, timeout=60) as b,
            ):
                cid = await start(a)
                held = Script(gate=asyncio.Event())  # never let go: the replica dies first
                api.then(held)
                dying = turn(a, cid, "dies with its replica")
                await held.started.wait()
                doomed.process.signal(signal.SIGKILL)
                killed = time.monotonic()
                after = await b.post(CHAT, json={"message": "after", "conversation_id": cid})
                took = time.monotonic() - killed
                with pytest.raises(httpx.TransportError):
                    await dying
                assert held.gate is not None
                held.gate.set()  # the fake API may finish its (orphaned) answer
                assert after.status_code == 200, after.text
                assert after.json()["revision"] == 2  # nothing of the killed turn was kept
                assert took < lease_s + 3, took
                view = (await b.get(f"/api/v1/conversations/{cid}")).json()
                assert [m["content"] for m in view["messages"][::2]] == ["first", "after"]


async def test_a_holder_whose_lease_expired_loses_to_the_turn_that_took_it(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    settings = Settings(database_url=database_url, turn_lease_s=1)
    stale = create_app(
        settings,
        backend=postgres_backend(settings, store=failing_renewals(engine)),
        provider=api.provider(),
    )
    fresh = create_app(settings, provider=api.provider())
    async with (
        serve(stale) as stale_url,
        serve(fresh) as fresh_url,
        httpx.AsyncClient(base_url=stale_url, timeout=60) as a,
        httpx.AsyncClient(base_url=fresh_url, timeout=60) as b,
    ):
        cid = await start(a)
        a_gate, b_gate = asyncio.Event(), asyncio.Event()
        a_slow, b_slow = Script(gate=a_gate), Script(gate=b_gate)
        api.then(a_slow)
        a_turn = turn(a, cid, "stale holder")
        await a_slow.started.wait()
        await until_lease_expired(engine, cid)  # renewals fail: the lease runs out
        api.then(b_slow)
        b_turn = turn(b, cid, "took the lease")
        await b_slow.started.wait()  # B holds the lease now
        a_gate.set()
        assert_error(await a_turn, 409, "conversation_conflict")
        b_gate.set()
        assert (await b_turn).json()["revision"] == 2
        view = (await b.get(f"/api/v1/conversations/{cid}")).json()
        assert [m["content"] for m in view["messages"][::2]] == ["first", "took the lease"]


async def test_many_clients_on_two_replicas_queue_every_turn_into_its_place(
    database: str, tmp_path: Path
) -> None:
    conversations, clients_count, turns_each = 3, 16, 6
    api = FakeResponsesAPI()
    rng = random.Random(7)
    async with replicas(database, tmp_path, api) as (a, b):
        ids = [await start(a) for _ in range(conversations)]
        answers: list[tuple[str, str, Any]] = []

        async def client(number: int) -> None:
            for n in range(turns_each):
                cid, message = rng.choice(ids), f"client {number} turn {n}"
                replica = a if (number + n) % 2 else b
                response = await replica.post(
                    CHAT, json={"message": message, "conversation_id": cid}
                )
                assert response.status_code == 200, response.text
                answers.append((cid, message, response.json()))

        started = time.monotonic()
        await asyncio.gather(*(client(n) for n in range(clients_count)))
        elapsed = time.monotonic() - started
        for cid in ids:
            view = (await a.get(f"/api/v1/conversations/{cid}", params={"limit": 200})).json()
            mine = sorted((r["revision"], m, r["message"]) for c, m, r in answers if c == cid)
            assert view["revision"] == len(mine) + 1  # the first turn, then every 200, once
            assert [rev for rev, _, _ in mine] == list(range(2, view["revision"] + 1))
            texts = [m["content"] for m in view["messages"]]
            for revision, message, reply in mine:
                assert texts[2 * revision - 2 : 2 * revision] == [message, reply]
    turns = clients_count * turns_each
    assert len(api.requests) == turns + conversations  # not one provider call wasted
    print(
        f"\nqueued: {turns} turns, {clients_count} clients, 2 replicas, {conversations} "
        f"conversations in {elapsed:.1f} s ({turns / elapsed:.0f} turns/s)"
    )


class RefusedReleases(PostgresPlaces):
    """A seam: this replica's lease release is a statement the server refuses for good (an
    undefined table, SQLSTATE 42P01, as Citus refuses what it does not support with 0A000);
    the tries are counted."""

    tries = 0

    def __init__(self, db: Adapter) -> None:
        super().__init__(db)
        db.sql.release_lease = sql(
            "UPDATE no_such_table SET lease_holder = NULL"
            " WHERE id = :cid AND lease_holder = :holder RETURNING lease_wanted"
        )

    async def release_lease(self, conversation_id: uuid.UUID, holder: uuid.UUID) -> None:
        self.tries += 1
        await super().release_lease(conversation_id, holder)


async def test_a_release_the_database_refuses_for_good_is_not_retried_and_logged_once(
    database_url: str, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeResponsesAPI()
    settings = Settings(database_url=database_url)
    store = PostgresStore.over(engine)
    refused = RefusedReleases(store.db)
    store = replace(store, places=refused)
    app = create_app(
        settings, backend=postgres_backend(settings, store=store), provider=api.provider()
    )
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        cid = await start(client)
        for _ in range(2):  # two turns that fail: each gives its lease back, refused
            api.then(Script(http_status=500, error_code="server_error"))
            failed = await client.post(CHAT, json={"message": "fails", "conversation_id": cid})
            assert failed.status_code == 502, failed.text
        await asyncio.sleep(4 * RELEASE_RETRY_S)  # a retry would have come meanwhile
    assert refused.tries == 2
    logged = [r for r in caplog.records if "refuses to give turn leases back" in r.getMessage()]
    assert len(logged) == 1 and "42P01" in logged[0].getMessage()
