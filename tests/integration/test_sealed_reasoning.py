"""Encrypted reasoning only decrypts where it was sealed: per-turn origins, leaving foreign
reasoning out, and the one retry on invalid_encrypted_content."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script, openai_id
from tests.support.helpers import CHAT, assert_error, snapshot


def first_output() -> dict[str, Any]:
    """The message item the fake answered to its second call."""
    return {
        "id": openai_id("msg", 2), "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": "reply 2", "annotations": [], "logprobs": []}],
    }  # fmt: skip


def types(request: dict[str, Any]) -> list[str]:
    return [item.get("type", "message") for item in request["input"]]


async def test_reasoning_sealed_by_another_model_is_left_out(make_client: ClientFactory) -> None:
    first, second = FakeResponsesAPI(), FakeResponsesAPI()
    async with make_client(provider=first.provider(model="model-a")) as client:
        cid = (await client.post(CHAT, json={"message": "one"})).json()["conversation_id"]
        await client.post(CHAT, json={"message": "two", "conversation_id": cid})
    async with make_client(provider=second.provider(model="model-b")) as client:
        response = await client.post(CHAT, json={"message": "three", "conversation_id": cid})
        assert response.status_code == 200
        await client.post(CHAT, json={"message": "four", "conversation_id": cid})
    # model-b gets model-a's turns without their reasoning, everything else verbatim.
    sent = second.requests[0]
    assert types(sent) == ["message"] * 5
    from_a = first.requests[1]["input"] + [first_output()]
    assert sent["input"][:4] == [item for item in from_a if item.get("type") != "reasoning"]
    # ... and its own reasoning from turn three is replayed in turn four.
    assert types(second.requests[1]) == ["message"] * 5 + ["reasoning", "message", "message"]


async def test_invalid_encrypted_content_gets_one_retry_without_sealed_reasoning(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        cid = (await client.post(CHAT, json={"message": "one"})).json()["conversation_id"]
        api.then(Script(http_status=400, error_code="invalid_encrypted_content"))
        response = await client.post(CHAT, json={"message": "two", "conversation_id": cid})
        assert response.status_code == 200 and response.json()["revision"] == 2
    assert types(api.requests[1]) == ["message", "reasoning", "message", "message"]
    assert types(api.requests[2]) == ["message", "message", "message"]
    assert api.requests[2]["input"] == [
        item for item in api.requests[1]["input"] if item.get("type") != "reasoning"
    ]


async def test_each_turn_records_its_origin(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    async with make_client(provider=FakeResponsesAPI().provider()) as client:
        await client.post(CHAT, json={"message": "hi"})
    async with engine.connect() as conn:
        row = (await conn.execute(text("SELECT provider, endpoint, model FROM turns"))).one()
    assert tuple(row) == ("openai", "https://fake.invalid/v1/responses", "gpt-test")


async def test_the_retry_happens_once_and_only_when_something_can_be_dropped(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    invalid = Script(http_status=400, error_code="invalid_encrypted_content")
    async with make_client(provider=api.provider()) as client:
        # A first turn has no history to drop: no retry.
        api.then(invalid)
        assert_error(await client.post(CHAT, json={"message": "x"}), 502, "upstream_error")
        assert len(api.requests) == 1
        cid = (await client.post(CHAT, json={"message": "one"})).json()["conversation_id"]
        before = await snapshot(engine)
        api.then(invalid, invalid)
        failed = await client.post(CHAT, json={"message": "two", "conversation_id": cid})
        assert_error(failed, 502, "upstream_error")
        assert len(api.requests) == 4  # one call, one retry, no more
        assert await snapshot(engine) == before
