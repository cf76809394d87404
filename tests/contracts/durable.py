"""Durable turns ("12. Durable turns"): a turn survives its client. Real `turnstore serve`
replicas on one database and the fake Responses API over loopback HTTP for what crosses
processes (resume elsewhere, cancel from elsewhere, a replica killed or stopped); in-process
apps on the test database for what one replica decides (owners, expiry, deletion, retries)."""

from __future__ import annotations

import asyncio
import time

import httpx
from httpx_sse import aconnect_sse

from tests.conftest import ClientFactory
from tests.support.events import (
    STREAM,
    TURNS,
    event_of,
    follow,
    status_becomes,
    text_of,
)
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer

# --- across replicas ---------------------------------------------------------------------------


# --- one replica ---------------------------------------------------------------------------------


async def test_a_reader_after_the_end_gets_the_whole_stream_until_its_events_expire(
    make_client: ClientFactory,
) -> None:
    async with make_client(turn_events_ttl_s=1) as client:
        async with aconnect_sse(client, "POST", STREAM, json={"message": "hello"}) as source:
            turn_id = source.response.headers["X-Turn-Id"]
            live = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert [e.id for e in live] == list(range(1, len(live) + 1))
        assert live[-1].data["turn_id"] == turn_id
        assert await follow(client, turn_id) == live
        assert await follow(client, turn_id, after=2) == live[2:]
        assert await follow(client, turn_id, last_event_id=len(live)) == []
        deadline = time.monotonic() + 10
        while (await client.get(f"{TURNS}/{turn_id}")).status_code == 200:
            assert time.monotonic() < deadline, "the events never expired"
            await asyncio.sleep(0.1)
        assert_error(await client.get(f"{TURNS}/{turn_id}"), 404, "turn_not_found")
        assert_error(await client.get(f"{TURNS}/{turn_id}/events"), 404, "turn_not_found")


async def test_an_idempotency_key_retry_of_a_background_v1_response_names_the_same_response(
    make_client: ClientFactory,
) -> None:
    """On /v1 too: a retry (while it runs, and once it ran) answers the first response's id,
    which retrieves it. The retry's id was made with the retry's own new conversation, so it
    named no response (404)."""
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(text="once", gate=gate)
    api.then(held)
    key = {"Idempotency-Key": "bg-v1-retry-1"}
    body = {"input": "hi", "background": True}
    async with make_client(provider=api.provider()) as client:
        first = await client.post("/v1/responses", json=body, headers=key)
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        await held.started.wait()
        while_running = await client.post("/v1/responses", json=body, headers=key)
        assert while_running.status_code == 200, while_running.text
        assert while_running.json()["id"] == rid
        gate.set()
        for _ in range(200):
            found = await client.get(f"/v1/responses/{rid}")
            assert found.status_code == 200, found.text
            if found.json()["status"] == "completed":
                break
            await asyncio.sleep(0.02)
        assert found.json()["status"] == "completed", found.text
        after = await client.post("/v1/responses", json=body, headers=key)
        assert after.status_code == 200, after.text
        assert after.json()["id"] == rid
        assert len(api.requests) == 1  # neither retry called the provider


async def test_an_idempotency_key_retry_of_a_background_turn_names_the_same_turn(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(text="once", gate=gate)
    api.then(held)
    key = {"Idempotency-Key": "bg-retry-1"}
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "hi", "background": True}, headers=key)
        assert first.status_code == 202, first.text
        await held.started.wait()
        while_running = await client.post(
            CHAT, json={"message": "hi", "background": True}, headers=key
        )
        assert while_running.status_code == 202, while_running.text
        # The first attempt's conversation and status, not a new conversation's id.
        assert while_running.json() == {**first.json(), "status": "in_progress"}
        # A retry on the stream follows the running turn's events to their end.
        async with aconnect_sse(
            client, "POST", STREAM, json={"message": "hi", "background": True}, headers=key
        ) as source:
            assert source.response.status_code == 200, await source.response.aread()
            assert source.response.headers["X-Turn-Id"] == first.json()["turn_id"]
            gate.set()
            followed = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert followed[-1].name == "message.done" and text_of(followed) == "once"
        await status_becomes(client, first.json()["turn_id"], "completed")
        after = await client.post(CHAT, json={"message": "hi", "background": True}, headers=key)
        assert after.status_code == 202, after.text
        assert after.json() == {**first.json(), "status": "completed"}
        async with aconnect_sse(
            client, "POST", STREAM, json={"message": "hi", "background": True}, headers=key
        ) as source:
            assert source.response.headers["X-Turn-Id"] == first.json()["turn_id"]
            replayed = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert text_of(replayed) == "once"
    assert len(api.requests) == 1  # one provider call for all of it


async def test_only_the_owner_reads_or_cancels_a_turn(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    api.then(Script(gate=gate))
    async with make_client(provider=api.provider(), **JWT_SETTINGS) as client:
        alice, mallory = jwt_bearer("alice"), jwt_bearer("mallory")
        mine = {"message": "mine", "background": True}
        turn_id = (await client.post(CHAT, json=mine, headers=alice)).json()["turn_id"]
        unknown = "00000000-0000-4000-8000-000000000000"
        for target in (turn_id, unknown, "not-a-uuid"):
            for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
                response = await client.request(method, f"{TURNS}/{target}{path}", headers=mallory)
                assert_error(response, 404, "turn_not_found")
        gate.set()
        view = await status_becomes(client, turn_id, "completed", alice)
        assert view["revision"] == 1


async def streamed_turn(client: httpx.AsyncClient) -> tuple[str, str]:
    """(turn id, conversation id) of a streamed turn, run to its end."""
    async with aconnect_sse(client, "POST", STREAM, json={"message": "hi"}) as source:
        events = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert events[-1].name == "message.done", events
        return source.response.headers["X-Turn-Id"], source.response.headers["X-Conversation-Id"]
