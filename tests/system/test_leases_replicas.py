"""Turn leases across `turnstore serve` replicas on one database: busy or queued turns, a killed
replica's lease, many clients queueing into their places. In-process cases are in
tests/integration/test_leases.py."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_leases import turn
from tests.support.cluster import (
    fake_api,
    provider_env,
    replica,
    replicas,
    turnstore_env,
    wait_ready,
)
from tests.support.fakeapi import FakeResponsesAPI, Script, output_items
from tests.support.helpers import (
    CHAT,
    assert_error,
    start,
)

FAST_S = 0.1  # "at once": a refusal comes back within this


async def until_waiting(client: httpx.AsyncClient, in_flight: int) -> None:
    """Until the replica has one turn waiting for a lease (``in_flight``: its requests now)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = (await client.get("/metrics")).text
        if "turnstore_turns_waiting 1.0" in metrics:
            return
        assert time.monotonic() < deadline, f"no turn waits ({in_flight} in flight)"
        await asyncio.sleep(0.02)


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
