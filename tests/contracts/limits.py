"""Limits: one owner cannot hurt the others (the contract's "Limits")."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from service.core.ids import Ids
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer

TURNS = "/api/v1/turns"


async def opened(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> int:
    """The status a reader of ``url`` is answered with (the stream is left at once)."""
    async with client.stream("GET", url, headers=headers) as response:
        return response.status_code


async def until_opened(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float = 10
) -> None:
    """A slot frees when the server has seen a reader go: poll until a new one is let in."""
    deadline = time.monotonic() + timeout_s
    while (status := await opened(client, url, headers)) == 429:
        assert time.monotonic() < deadline, "no reader's slot was freed"
        await asyncio.sleep(0.02)
    assert status == 200, status


async def test_an_owner_past_their_event_readers_gets_429_and_others_read_on(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    stall = asyncio.Event()
    api.then(*(Script(text="slow reply", deltas=3, stall=stall) for _ in range(3)))
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    settings: dict[str, Any] = {"owner_max_event_readers": 2, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        started = [
            await client.post(CHAT, json={"message": m, "background": True}, headers=who)
            for m, who in (("a", alice), ("b", bob))
        ]
        a_turn, b_turn = (s.json()["turn_id"] for s in started)
        made = await client.post("/v1/responses", json={"input": "c", "background": True},
                                 headers=alice)  # fmt: skip
        a_response = made.json()["id"]
        async with AsyncExitStack() as readers:
            for _ in range(2):
                source = await readers.enter_async_context(
                    aconnect_sse(client, "GET", f"{TURNS}/{a_turn}/events", headers=alice)
                )
                assert source.response.status_code == 200
            refused = await client.get(f"{TURNS}/{a_turn}/events", headers=alice)
            assert_error(refused, 429, "too_many_requests")  # JSON, before any stream
            assert refused.headers["Retry-After"] == "1"
            resumed = await client.get(f"/v1/responses/{a_response}?stream=true", headers=alice)
            assert resumed.status_code == 429, resumed.text
            assert resumed.json()["error"]["code"] == "too_many_requests"
            # Another owner reads on.
            assert await opened(client, f"{TURNS}/{b_turn}/events", bob) == 200
        await until_opened(client, f"{TURNS}/{a_turn}/events", alice)
        stall.set()


# --- running turns: counted for the owner on the whole fleet ----------------------------------


async def started(*scripts: Script, timeout_s: float = 10) -> None:
    """Until the provider has begun answering each of ``scripts``."""
    async with asyncio.timeout(timeout_s):
        for script in scripts:
            await script.started.wait()


async def test_an_owner_past_their_running_turns_gets_429_on_every_replica(
    make_client: ClientFactory,
) -> None:
    """Three turns of alice run (a warm plain turn on one replica, a first turn and a
    background turn on the other): her fourth is 429 on both replicas, whatever it is (plain,
    streamed, background, /v1, warm or new), before the provider is called and with nothing
    kept; bob runs on; once hers end, she runs again."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    held = [Script(text="held", gate=gate) for _ in range(3)]
    api.then(Script(text="one"), Script(text="two"), *held, Script(text="bob"), Script())
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    settings: dict[str, Any] = {"owner_max_running_turns": 3, **JWT_SETTINGS}
    async with (
        make_client(provider=api.provider(), **settings) as one,
        make_client(provider=api.provider(), **settings) as two,
    ):
        first, other = [
            (await one.post(CHAT, json={"message": m}, headers=alice)).json()["conversation_id"]
            for m in ("one", "two")
        ]
        running = [
            asyncio.create_task(
                one.post(CHAT, json={"message": "warm", "conversation_id": first}, headers=alice)
            ),
            asyncio.create_task(two.post(CHAT, json={"message": "new"}, headers=alice)),
        ]
        background = await two.post(CHAT, json={"message": "bg", "background": True},
                                    headers=alice)  # fmt: skip
        assert background.status_code == 202, background.text
        await started(*held)
        calls = len(api.requests)
        for client in (one, two):
            for path, body in (
                (CHAT, {"message": "plain"}),
                (CHAT, {"message": "warm", "conversation_id": other}),
                (CHAT, {"message": "bg", "background": True}),
                (f"{CHAT}/stream", {"message": "streamed"}),
                (f"{CHAT}/stream", {"message": "warm", "conversation_id": other}),
            ):
                refused = await client.post(path, json=body, headers=alice)
                assert_error(refused, 429, "too_many_requests")  # JSON, a stream's too
                assert refused.headers["Retry-After"] == "1"
            for path, body in (
                ("/v1/responses", {"input": "hi"}),
                ("/v1/responses", {"input": "hi", "store": False}),  # a provider call all the same
                ("/v1/responses", {"input": "hi", "store": False, "stream": True}),
                ("/v1/responses/compact", {"input": "hi", "model": "gpt-test"}),
            ):
                v1 = await client.post(path, json=body, headers=alice)
                assert v1.status_code == 429, (body, v1.text)
                assert v1.json()["error"]["code"] == "too_many_requests"
                assert v1.headers["Retry-After"] == "1"
        assert len(api.requests) == calls  # the provider was not called
        kept = await one.get(f"/api/v1/conversations/{other}", headers=alice)
        assert kept.json()["revision"] == 1  # nothing kept
        assert (await two.post(CHAT, json={"message": "b"}, headers=bob)).status_code == 200
        gate.set()
        assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
        turn = await until_finished(one, background.json()["turn_id"], alice)
        assert turn["status"] == "completed", turn
        again = await two.post(CHAT, json={"message": "again"}, headers=alice)
        assert again.status_code == 200, again.text


async def test_a_turn_that_ends_without_its_commit_gives_its_place_back(
    make_client: ClientFactory,
) -> None:
    """With room for one turn, each that fails (the provider's 500, plain and streamed, new and
    warm), is filtered or cancelled leaves the room to the next at once."""
    api = FakeResponsesAPI()
    failed = Script(http_status=500, error_code="server_error")
    filtered = Script(status="incomplete", incomplete_reason="content_filter")
    held = Script(gate=asyncio.Event())  # the background turn's: never answered
    api.then(Script(), failed, failed, filtered, failed, held, Script())
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 1, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        made = await client.post(CHAT, json={"message": "first"}, headers=alice)
        warm = {"message": "again", "conversation_id": made.json()["conversation_id"]}
        assert_error(await client.post(CHAT, json={"message": "new"}, headers=alice), 502,
                     "upstream_error")  # fmt: skip
        assert_error(await client.post(CHAT, json=warm, headers=alice), 502, "upstream_error")
        assert_error(await client.post(CHAT, json=warm, headers=alice), 422, "content_filtered")
        streamed = await client.post(f"{CHAT}/stream", json=warm, headers=alice)
        assert streamed.status_code == 200 and "event: error" in streamed.text
        background = await client.post(CHAT, json={**warm, "background": True}, headers=alice)
        turn_id = background.json()["turn_id"]
        # Cancelled while the provider works on it (cancelled before it asked, it left the
        # held answer to the next turn, which then waited on it forever).
        await asyncio.wait_for(held.started.wait(), 10)
        cancelled = await client.post(f"{TURNS}/{turn_id}/cancel", headers=alice)
        assert cancelled.json()["status"] == "cancelled", cancelled.text
        done = await client.post(CHAT, json=warm, headers=alice)
        assert done.status_code == 200, done.text  # not 429: every place came back


async def test_stateless_calls_hold_a_place_while_they_run_and_give_it_back(
    make_client: ClientFactory,
) -> None:
    """With room for one: a stateless call (plain, then streamed) and a relayed compaction
    each hold the place while the provider works, and leave it when they end."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    held = Script(text="held", gate=gate)
    api.then(held, Script(), Script())
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 1, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        stateless = {"input": "hi", "store": False}
        running = asyncio.create_task(client.post("/v1/responses", json=stateless, headers=alice))
        await started(held)
        refused = await client.post(CHAT, json={"message": "meanwhile"}, headers=alice)
        assert_error(refused, 429, "too_many_requests")
        gate.set()
        assert (await running).status_code == 200
        streamed = await client.post(
            "/v1/responses", json={**stateless, "stream": True}, headers=alice
        )
        assert streamed.status_code == 200 and "response.completed" in streamed.text
        compacted = await client.post("/v1/responses/compact",
                                      json={"input": "hi", "model": "gpt-test"},
                                      headers=alice)  # fmt: skip
        assert compacted.status_code == 200, compacted.text
        after = await client.post(CHAT, json={"message": "after"}, headers=alice)
        assert after.status_code == 200, after.text  # every place came back


async def test_a_streamed_turn_queued_behind_another_is_not_counted_while_it_waits(
    make_client: ClientFactory,
) -> None:
    """With room for two: a turn runs on a conversation and a background turn queues behind
    it; meanwhile the owner can still start a turn elsewhere (the queued one gave its place
    back while it waits), and the queued one runs when the first ends."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    first = Script(text="first", gate=gate)
    api.then(Script(), first, Script(text="elsewhere"), Script(text="queued"))
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 2, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        made = await client.post(CHAT, json={"message": "made"}, headers=alice)
        warm = {"message": "warm", "conversation_id": made.json()["conversation_id"]}
        running = asyncio.create_task(client.post(CHAT, json=warm, headers=alice))
        await started(first)
        queued = await client.post(CHAT, json={**warm, "background": True}, headers=alice)
        assert queued.status_code == 202, queued.text
        turn_id = queued.json()["turn_id"]
        deadline = time.monotonic() + 10
        while (elsewhere := await client.post(CHAT, json={"message": "x"}, headers=alice)
               ).status_code == 429:  # fmt: skip
            assert time.monotonic() < deadline, "the queued turn kept its place"
            await asyncio.sleep(0.02)  # until the queued turn has found the lease taken
        assert elsewhere.status_code == 200, elsewhere.text
        gate.set()
        assert (await running).status_code == 200
        assert (await until_finished(client, turn_id, alice))["status"] == "completed"


async def until_finished(
    client: httpx.AsyncClient, turn_id: str, headers: dict[str, str], timeout_s: float = 10
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (turn := (await client.get(f"{TURNS}/{turn_id}", headers=headers)).json())["status"] in (
        "queued",
        "in_progress",
    ):
        assert time.monotonic() < deadline, turn
        await asyncio.sleep(0.02)
    return dict(turn)


async def test_replicas_racing_for_the_last_places_never_run_more_than_the_limit(
    make_client: ClientFactory,
) -> None:
    """Twelve first turns of one owner at once, half on each replica, with room for four:
    exactly four reach the provider (the count is one owner's at a time in PostgreSQL, not a
    snapshot each replica reads), the others are 429, and the four commit."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    api.then(*(Script(text="raced", gate=gate) for _ in range(12)))
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 4, **JWT_SETTINGS}
    async with (
        make_client(provider=api.provider(), **settings) as one,
        make_client(provider=api.provider(), **settings) as two,
    ):
        turns = [
            asyncio.create_task(client.post(CHAT, json={"message": f"m{n}"}, headers=alice))
            for n in range(6)
            for client in (one, two)
        ]
        deadline = time.monotonic() + 20
        # Every turn either was refused or reached the provider (and waits at its gate).
        while sum(t.done() for t in turns) + len(api.requests) < len(turns):
            assert time.monotonic() < deadline, (len(api.requests), sum(t.done() for t in turns))
            await asyncio.sleep(0.02)
        assert len(api.requests) == 4
        gate.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*turns))
        assert statuses == [200] * 4 + [429] * 8


# --- memory: a request holds what it returns, not the conversation ---------------------------

MIB = 1024 * 1024


async def test_a_stateless_call_restores_from_at_most_20_conversations(
    make_client: ClientFactory, ids: Ids
) -> None:
    def named(n: int) -> dict[str, Any]:  # an item shown as one of another conversation's
        return {"type": "message", "role": "assistant", "content": "x",
                "id": ids.item(uuid.uuid4(), 1, n, None, "message")}  # fmt: skip

    async with make_client() as client:
        for count, says in ((21, "at most 20 conversations"), (20, "no stored item")):
            history = [*(named(n) for n in range(count)), {"role": "user", "content": "hi"}]
            body = {"input": history, "store": False, "model": "fake-llm"}
            refused = await client.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "input" and says in error["message"], error


# --- MAX_CONVERSATION_BYTES: a conversation holds at most so much ------------------------------

FULL_AT = 16 * 1024


async def items_of(client: httpx.AsyncClient, conversation: str) -> int:
    found = await client.get(f"/v1/conversations/{conversation}")
    assert found.status_code == 200, found.text
    listed = await client.get(f"/v1/conversations/{conversation}/items", params={"limit": 100})
    return len(listed.json()["data"])


# --- OWNER_MAX_FORKS_PER_MINUTE: forks counted fleet-wide, in PostgreSQL ------------------------


async def test_the_openapi_document_names_the_owner_limits_429(
    client: httpx.AsyncClient,
) -> None:
    """Every operation that starts a turn (or a fork) documents 429 too_many_requests."""
    paths = (await client.get("/schema/openapi.json")).json()["paths"]
    for path in (
        CHAT,
        f"{CHAT}/stream",
        "/v1/responses",
        "/api/v1/conversations/{conversation_id}/fork",
    ):
        described = paths[path]["post"]["responses"]["429"]["description"]
        assert "too_many_requests" in described, (path, described)
