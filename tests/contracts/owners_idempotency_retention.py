"""Ownership scoping, cursor listing, Idempotency-Key and retention, against real PostgreSQL."""

from __future__ import annotations

import asyncio

import httpx

from service.core.items import user_input_item
from service.core.model import Turn
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, assert_error


def turn(text_: str) -> Turn:
    return Turn(text_, f"re: {text_}", [user_input_item(text_)])


async def test_listing_through_http(client: httpx.AsyncClient) -> None:
    made = [
        (await client.post(CHAT, json={"message": f"m{n}"})).json()["conversation_id"]
        for n in range(3)
    ]
    first = (await client.get("/api/v1/conversations", params={"limit": 2})).json()
    assert [c["conversation_id"] for c in first["conversations"]] == made[::-1][:2]
    second = (
        await client.get("/api/v1/conversations", params={"limit": 2, "after": first["next"]})
    ).json()
    assert [c["conversation_id"] for c in second["conversations"]] == made[:1]
    assert second["next"] is None
    assert_error(
        await client.get("/api/v1/conversations", params={"after": "garbage!"}),
        400,
        "invalid_input",
    )
    assert_error(
        await client.get("/api/v1/conversations", params={"limit": 0}), 400, "invalid_input"
    )


async def test_an_idempotent_retry_returns_the_original_without_calling_the_model(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with (
        make_client(provider=api.provider()) as one,
        make_client(provider=api.provider()) as two,
    ):
        headers = {"Idempotency-Key": "retry-1"}
        first = await one.post(CHAT, json={"message": "bill me once"}, headers=headers)
        again = await two.post(
            CHAT, json={"message": "bill me once"}, headers=headers
        )  # other replica
        assert first.status_code == again.status_code == 200
        keep = ("conversation_id", "message", "revision", "status")
        assert {k: again.json()[k] for k in keep} == {k: first.json()[k] for k in keep}
        assert len(api.requests) == 1
        reused = await two.post(CHAT, json={"message": "something else"}, headers=headers)
        assert_error(reused, 422, "idempotency_key_reused")
        streamed = await two.post(
            f"{CHAT}/stream", json={"message": "bill me once"}, headers=headers
        )
        assert "event: message.done" in streamed.text and first.json()["message"] in streamed.text
        assert len(api.requests) == 1


async def test_concurrent_duplicates_one_runs_the_other_is_in_progress(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(gate=gate)
    api.then(held)
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "dup"}
        first = asyncio.create_task(client.post(CHAT, json={"message": "once"}, headers=headers))
        await held.started.wait()
        second = await client.post(CHAT, json={"message": "once"}, headers=headers)
        assert_error(second, 409, "request_in_progress")
        gate.set()
        assert (await first).status_code == 200
    assert len(api.requests) == 1


async def test_a_failed_turn_does_not_use_the_key_up(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(Script(http_status=500))
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "fails-first"}
        assert_error(
            await client.post(CHAT, json={"message": "x"}, headers=headers), 502, "upstream_error"
        )
        ok = await client.post(CHAT, json={"message": "x"}, headers=headers)
        assert ok.status_code == 200
    assert len(api.requests) == 2


async def test_the_stream_reports_idempotency_conflicts_as_json_before_it_starts(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(gate=gate)
    api.then(held)
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "stream-key"}
        first = asyncio.create_task(client.post(CHAT, json={"message": "a"}, headers=headers))
        await held.started.wait()
        running = await client.post(f"{CHAT}/stream", json={"message": "a"}, headers=headers)
        assert_error(running, 409, "request_in_progress")
        gate.set()
        assert (await first).status_code == 200
        reused = await client.post(f"{CHAT}/stream", json={"message": "b"}, headers=headers)
        assert_error(reused, 422, "idempotency_key_reused")
    assert len(api.requests) == 1
