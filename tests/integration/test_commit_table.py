"""The contract's "What commits" table, through HTTP, the real Responses adapter and a fake
Responses API: every failure leaves the stored conversation exactly as it was."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script, openai_id
from tests.support.helpers import CHAT, assert_error, snapshot

FAILURES = {
    "rate-limited": (Script(http_status=429, headers={"Retry-After": "7"}), 429, "rate_limited"),
    "context-too-long": (
        Script(http_status=400, error_code="context_length_exceeded"),
        400,
        "context_length_exceeded",
    ),
    "input-filtered": (
        Script(http_status=400, error_code="content_filter"),
        422,
        "content_filtered",
    ),
    "output-filtered": (
        Script(status="incomplete", incomplete_reason="content_filter", text="partial"),
        422,
        "content_filtered",
    ),
    "empty-text": (Script(text=""), 502, "upstream_error"),
    "server-error": (Script(http_status=500), 502, "upstream_error"),
    "other-4xx": (Script(http_status=404), 502, "upstream_error"),
    "failed-status": (Script(status="failed"), 502, "upstream_error"),
    "unparsable": (Script(raw_body=b"{not json"), 502, "upstream_error"),
    "read-timeout": (Script(exception=httpx.ReadTimeout("slow")), 504, "upstream_timeout"),
    "connect-timeout": (Script(exception=httpx.ConnectTimeout("down")), 504, "upstream_timeout"),
    "connect-error": (Script(exception=httpx.ConnectError("refused")), 502, "upstream_error"),
}


async def test_max_output_tokens_commits_the_text_received(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI().then(
        Script(status="incomplete", incomplete_reason="max_output_tokens", text="cut sho")
    )
    async with make_client(provider=api.provider()) as client:
        response = await client.post(CHAT, json={"message": "long please"})
        body = response.json()
        assert response.status_code == 200
        assert (body["status"], body["incomplete_reason"]) == ("incomplete", "max_output_tokens")
        read = await client.get(f"/api/v1/conversations/{body['conversation_id']}")
        assert read.json()["messages"][-1] == {
            "role": "assistant",
            "content": "cut sho",
            "in_context": True,
        }


async def test_second_turn_resends_first_turn_verbatim(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "hi"})
        cid = first.json()["conversation_id"]
        await client.post(CHAT, json={"message": "and?", "conversation_id": cid})
    sent_first, sent_second = api.requests
    assert sent_first["store"] is False
    assert sent_first["include"] == ["reasoning.encrypted_content"]
    first_output = [
        {
            "id": openai_id("rs", 1),
            "type": "reasoning",
            "summary": [],
            "encrypted_content": "gAAA-sealed-1==",
        },
    ]
    assert sent_second["input"][: len(sent_first["input"])] == sent_first["input"]
    replayed = sent_second["input"][len(sent_first["input"]) : -1]
    assert replayed[0] == first_output[0]
    assert replayed[1]["type"] == "message" and replayed[1]["content"][0]["text"] == "reply 1"
    assert sent_second["input"][-1]["content"][0]["text"] == "and?"


async def test_client_cannot_see_provider_error_bodies(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(
        Script(raw_body=b'{"error": "sk-secret-123 leaked"}', http_status=503)
    )
    async with make_client(provider=api.provider()) as client:
        response: httpx.Response = await client.post(CHAT, json={"message": "x"})
    assert_error(response, 502, "upstream_error")
    assert "sk-secret" not in response.text and "sk-test" not in response.text


@pytest.mark.parametrize(("script", "status", "code"), FAILURES.values(), ids=FAILURES.keys())
async def test_failed_turn_leaves_no_trace(
    make_client: ClientFactory, engine: AsyncEngine, script: Script, status: int, code: str
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "one"})
        cid = first.json()["conversation_id"]
        before = await snapshot(engine)

        api.then(script)
        failed = await client.post(CHAT, json={"message": "two", "conversation_id": cid})
        assert_error(failed, status, code)
        assert await snapshot(engine) == before
        if code == "rate_limited":
            assert failed.headers["retry-after"] == "7"

        api.then(script)
        failed_first = await client.post(CHAT, json={"message": "new"})
        assert_error(failed_first, status, code)
        assert await snapshot(engine) == before  # no conversation row for a failed first turn

        # No automatic retries: one provider call per attempt.
        assert len(api.requests) == 3
        again = await client.post(CHAT, json={"message": "two", "conversation_id": cid})
        assert again.status_code == 200 and again.json()["revision"] == 2
