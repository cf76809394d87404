"""The HTTP surface: the error envelope for every code this API produces, correlation ids,
ETag / If-Match, limits, operations endpoints and the OpenAPI document."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import CHAT, assert_error

BAD_BODIES = {
    "malformed": b'{"message": ',
    "not-an-object": b'["ping"]',
    "duplicate-key": b'{"message": "a", "message": "b"}',
    "unknown-key": b'{"message": "a", "temperature": 0.5}',
    "wrong-type": b'{"message": 42}',
    "null-message": b'{"message": null}',
    "missing-message": b'{"conversation_id": null}',
    "empty": b'{"message": ""}',
    "whitespace": b'{"message": " \\n\\t "}',
    "nul-character": b'{"message": "a\\u0000b"}',
    "lone-surrogate": b'{"message": "\\ud800"}',
    "not-utf8": b'{"message": "\xff\xfe"}',
    "wrong-id-type": b'{"message": "a", "conversation_id": 7}',
}


@pytest.mark.parametrize("path", [CHAT, f"{CHAT}/stream"])
@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_input_is_invalid_input_and_never_reaches_the_provider(
    make_client: ClientFactory, path: str, body: bytes
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    assert_error(response, 400, "invalid_input")
    assert api.requests == []


async def test_message_length_and_body_size_limits(make_client: ClientFactory) -> None:
    async with make_client(max_message_chars=10, max_body_bytes=200) as client:
        assert (await client.post(CHAT, json={"message": "x" * 10})).status_code == 200
        assert_error(await client.post(CHAT, json={"message": "x" * 11}), 400, "invalid_input")
        assert_error(await client.post(CHAT, json={"message": "x" * 300}), 413, "payload_too_large")


@pytest.mark.parametrize(
    "cid", ["not-a-uuid", str(uuid.uuid4()), "00000000-0000-0000-0000-000000000000"]
)
async def test_unknown_or_malformed_conversation_is_404_everywhere(
    client: httpx.AsyncClient, cid: str
) -> None:
    assert_error(await client.get(f"/api/v1/conversations/{cid}"), 404, "conversation_not_found")
    assert_error(await client.delete(f"/api/v1/conversations/{cid}"), 404, "conversation_not_found")
    for path in (CHAT, f"{CHAT}/stream"):
        response = await client.post(path, json={"message": "hi", "conversation_id": cid})
        assert_error(response, 404, "conversation_not_found")


async def test_framework_errors_use_the_envelope(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/api/v1/nope"), 404, "not_found")
    error = assert_error(await client.put(CHAT, json={"message": "x"}), 405, "method_not_allowed")
    assert "Traceback" not in error["message"]


async def test_correlation_id_is_reused_when_safe_and_made_otherwise(
    client: httpx.AsyncClient,
) -> None:
    sent = "req-123:abc/DEF_4.5"
    ok = await client.post(CHAT, json={"message": "x"}, headers={"X-Correlation-Id": sent})
    assert ok.headers["x-correlation-id"] == sent == ok.json()["correlation_id"]
    for unsafe in ("has space", "x" * 129, "semi;colon"):
        response = await client.get("/healthz", headers={"X-Correlation-Id": unsafe})
        assert response.headers["x-correlation-id"] not in ("", unsafe)
    error = await client.get("/nope", headers={"X-Correlation-Id": sent})
    assert assert_error(error, 404, "not_found")["correlation_id"] == sent


async def test_if_match_is_checked_before_the_provider_is_called(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        created = await client.post(CHAT, json={"message": "one"})
        cid, etag = created.json()["conversation_id"], created.headers["etag"]
        assert etag == '"1"'
        for stale in ('"2"', '"0"', 'W/"1"', "1", "garbage"):
            for path in (CHAT, f"{CHAT}/stream"):
                response = await client.post(
                    path,
                    json={"message": "two", "conversation_id": cid},
                    headers={"If-Match": stale},
                )
                assert_error(response, 412, "precondition_failed")
        assert len(api.requests) == 1
        # If-Match without a conversation cannot match anything.
        response = await client.post(CHAT, json={"message": "x"}, headers={"If-Match": '"1"'})
        assert_error(response, 412, "precondition_failed")
        ok = await client.post(
            CHAT, json={"message": "two", "conversation_id": cid}, headers={"If-Match": '"0", "1"'}
        )
        assert ok.status_code == 200 and ok.headers["etag"] == '"2"'
        read = await client.get(f"/api/v1/conversations/{cid}")
        assert read.headers["etag"] == '"2"' and read.json()["revision"] == 2


async def test_delete_honours_if_match_and_removes_everything(client: httpx.AsyncClient) -> None:
    cid = (await client.post(CHAT, json={"message": "one"})).json()["conversation_id"]
    path = f"/api/v1/conversations/{cid}"
    assert_error(await client.delete(path, headers={"If-Match": '"7"'}), 412, "precondition_failed")
    assert (await client.get(path)).status_code == 200
    deleted = await client.delete(path, headers={"If-Match": '"1"'})
    assert deleted.status_code == 204 and "x-correlation-id" in deleted.headers
    assert_error(await client.get(path), 404, "conversation_not_found")
    again = await client.post(CHAT, json={"message": "two", "conversation_id": cid})
    assert_error(again, 404, "conversation_not_found")


async def test_health_readiness_and_openapi(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    document = await client.get("/schema")  # the contract's path serves the document itself
    assert document.status_code == 200 and "json" in document.headers["content-type"]
    schema = document.json()
    assert (await client.get("/schema/openapi.json")).json() == schema
    text = str(schema)
    for header in ("If-Match", "ETag", "X-Correlation-Id", "X-Conversation-Id", "Retry-After"):
        assert header in text, header
    assert {
        "/api/v1/chat",
        "/api/v1/chat/stream",
        "/api/v1/conversations/{conversation_id}",
    } <= set(schema["paths"])
    # POST /v1/responses answers a Response, or (stream) its events: both documented.
    answers = schema["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= set(answers)
