"""Limits: one owner cannot hurt the others (the contract's "Limits")."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from tests.conftest import ClientFactory
from tests.fakeapi import FakeResponsesAPI, Script
from tests.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer

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
