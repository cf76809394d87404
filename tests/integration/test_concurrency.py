"""Concurrent turns: serialised within a replica, conditional across replicas, and a
database that fails while the provider call is in flight."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from tests.conftest import ClientFactory
from tests.support.database import read_only
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, assert_error, snapshot


async def test_twenty_concurrent_turns_on_one_conversation_are_serialised(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "start"})
        cid = first.json()["conversation_id"]
        responses = await asyncio.gather(
            *(
                client.post(CHAT, json={"message": f"m{n}", "conversation_id": cid})
                for n in range(20)
            )
        )
        assert [r.status_code for r in responses] == [200] * 20
        assert sorted(r.json()["revision"] for r in responses) == list(range(2, 22))
        transcript = (await client.get(f"/api/v1/conversations/{cid}")).json()["messages"]
    # Each call saw exactly the history committed before it: its input is the previous
    # call's input plus that call's output items, then its own user item.
    for previous, current in zip(api.requests, api.requests[1:], strict=False):
        assert current["input"][: len(previous["input"])] == previous["input"]
        assert len(current["input"]) == len(previous["input"]) + 3  # + reasoning, message, user
    assert len(transcript) == 42
    assert transcript[-1]["content"] == "reply 21"


async def test_two_replicas_racing_one_wins_the_other_gets_409(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    """Two replicas, each with its own pool: the turn that holds the lease runs; the other is
    refused at once (TURN_CONCURRENCY=reject) and writes nothing. (A holder whose lease expired
    and lost to a newer commit: tests/integration/test_leases.py.)"""
    slow, fast = FakeResponsesAPI(), FakeResponsesAPI()
    async with (
        make_client(provider=slow.provider(), turn_concurrency="reject") as replica_a,
        make_client(provider=fast.provider(), turn_concurrency="reject") as replica_b,
    ):
        cid = (await replica_a.post(CHAT, json={"message": "start"})).json()["conversation_id"]
        gate = asyncio.Event()
        held = Script(gate=gate)
        slow.then(held)
        turn_a = asyncio.create_task(
            replica_a.post(CHAT, json={"message": "from a", "conversation_id": cid})
        )
        await held.started.wait()  # replica A holds the lease and waits on the model
        before = await snapshot(engine)
        turn_b = await replica_b.post(CHAT, json={"message": "from b", "conversation_id": cid})
        assert_error(turn_b, 409, "conversation_busy")
        assert await snapshot(engine) == before  # the loser wrote nothing
        assert fast.requests == []  # nor called the model
        gate.set()
        assert (await turn_a).json()["revision"] == 2
        messages = (await replica_a.get(f"/api/v1/conversations/{cid}")).json()["messages"]
        assert [m["content"] for m in messages if m["role"] == "user"] == ["start", "from a"]


async def test_database_failure_at_commit_is_storage_error_then_recovers(
    make_client: ClientFactory, engine: AsyncEngine, server_url: str, database_url: str
) -> None:
    database = database_url.rsplit("/", 1)[1].split("?")[0]
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        cid = (await client.post(CHAT, json={"message": "start"})).json()["conversation_id"]
        before = await snapshot(engine)
        gate = asyncio.Event()
        held = Script(gate=gate)
        api.then(held)
        turn = asyncio.create_task(
            client.post(CHAT, json={"message": "doomed", "conversation_id": cid})
        )
        await held.started.wait()
        # The database turns read-only and every session of it is cut while the model works.
        async with read_only(server_url, database):
            gate.set()
            assert_error(await turn, 500, "storage_error")
        assert await snapshot(engine) == before
        after = await client.post(CHAT, json={"message": "recovered", "conversation_id": cid})
        assert after.status_code == 200, after.text
        assert after.json()["revision"] == 2
