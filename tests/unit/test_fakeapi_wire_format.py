"""The fake Responses API speaks the real wire format, as the official ``openai`` SDK models it.

Every JSON body validates as ``openai.types.responses.Response`` and every streamed event
against the ``ResponseStreamEvent`` union, with no field the SDK does not know (except those
in ``UNMODELLED``) and nothing coerced (the validated model dumps back to the same JSON).
The stream's order and consistency follow the API's streaming semantics.
"""

from __future__ import annotations

import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse
from openai.types import ErrorObject
from openai.types.responses import (
    Response,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseStreamEvent,
)
from pydantic import BaseModel, TypeAdapter

from tests.support.fakeapi import FakeResponsesAPI, Script

URL = "https://fake.invalid/v1/responses"
EVENT = TypeAdapter(ResponseStreamEvent)
# The SDK's model class for each event type, to check the union picked the right one.
EVENT_CLASSES: dict[str, type[BaseModel]] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
# Fields the real API sends that the SDK does not model: the response echoes `store`.
UNMODELLED = {(Response, "store")}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}

SCRIPTS = {
    "completed": Script(text="Hello, wire format!"),
    "no reasoning": Script(reasoning=False),
    "one delta": Script(text="x", deltas=1),
    "empty text": Script(text=""),
    "max_output_tokens": Script(status="incomplete", incomplete_reason="max_output_tokens"),
    "content_filter": Script(status="incomplete", incomplete_reason="content_filter"),
    "failed": Script(status="failed"),
    "error event": Script(error_code="context_length_exceeded"),
    "broken stream": Script(break_stream=True),
}
ERRORS = {
    "429": Script(http_status=429, error_code="rate_limit_exceeded"),
    "400 context": Script(http_status=400, error_code="context_length_exceeded"),
    "400 no code": Script(http_status=400),
    "500": Script(http_status=500, error_code="server_error"),
}


def unknown_fields(value: object, path: str = "$") -> list[str]:
    """Paths of fields the SDK's models took as extras, i.e. did not know."""
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in unknown_fields(v, f"{path}[{i}]")]
    if not isinstance(value, BaseModel):
        return []
    found = [
        f"{path}.{name}"
        for name in value.model_extra or {}
        if (type(value), name) not in UNMODELLED
    ]
    for name in type(value).model_fields:
        found += unknown_fields(getattr(value, name), f"{path}.{name}")
    return found


def assert_exact(model: BaseModel, payload: dict[str, Any]) -> None:
    assert unknown_fields(model) == []
    assert model.model_dump(mode="json", exclude_unset=True) == payload  # nothing coerced


def request(*, stream: bool) -> dict[str, Any]:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    return {
        "model": "gpt-test",
        "input": [item],
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "stream": stream,
    }


@pytest.fixture
async def fake_api_client() -> AsyncIterator[tuple[FakeResponsesAPI, httpx.AsyncClient]]:
    api = FakeResponsesAPI()
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as client:
        yield api, client


@pytest.mark.parametrize("name", SCRIPTS)
async def test_json_bodies_are_sdk_responses(
    fake_api_client: tuple[FakeResponsesAPI, httpx.AsyncClient], name: str
) -> None:
    api, http = fake_api_client
    api.then(SCRIPTS[name])
    answer = await http.post(URL, json=request(stream=False))
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    response = Response.model_validate(body)
    assert_exact(response, body)
    assert response.status == SCRIPTS[name].status
    kinds = [type(item) for item in response.output]
    reasoning = [ResponseReasoningItem] if SCRIPTS[name].reasoning else []
    assert kinds == reasoning + ([ResponseOutputMessage] if response.output_text else [])
    for item in response.output:
        if isinstance(item, ResponseReasoningItem):
            assert item.encrypted_content and item.summary == []
        else:
            assert isinstance(item, ResponseOutputMessage)
            assert [type(part) for part in item.content] == [ResponseOutputText]
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == SCRIPTS[name].incomplete_reason
    assert (response.error is not None) == (response.status == "failed")


@pytest.mark.parametrize("name", SCRIPTS)
async def test_streamed_events_are_sdk_stream_events(
    fake_api_client: tuple[FakeResponsesAPI, httpx.AsyncClient], name: str
) -> None:
    api, http = fake_api_client
    script = SCRIPTS[name]
    api.then(script)
    payloads: list[dict[str, Any]] = []
    async with aconnect_sse(http, "POST", URL, json=request(stream=True)) as source:
        assert source.response.status_code == 200
        async for sse in source.aiter_sse():  # raises unless the content type is SSE
            payload = json.loads(sse.data)
            assert payload["type"] in EVENT_CLASSES
            EVENT_CLASSES[payload["type"]].model_validate(payload)  # a readable failure first
            event = EVENT.validate_python(payload)
            assert isinstance(event, EVENT_CLASSES[payload["type"]])
            assert_exact(event, payload)
            assert sse.event == payload["type"]
            payloads.append(payload)
    assert script.closed.is_set()

    kinds = [payload["type"] for payload in payloads]
    assert [payload["sequence_number"] for payload in payloads] == list(range(len(payloads)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for payload in payloads[:2]:
        assert payload["response"]["status"] == "in_progress"
        assert payload["response"]["output"] == []
    assert not TERMINAL & set(kinds[:-1])  # at most one terminal event, and only last
    if script.break_stream:
        assert kinds[-1] not in TERMINAL
        return
    if script.error_code is not None:
        assert payloads[-1]["code"] == script.error_code
        return
    final = payloads[-1]["response"]
    assert kinds[-1] == f"response.{script.status}" == f"response.{final['status']}"
    assert_items_and_text_consistent(payloads, final)


def assert_items_and_text_consistent(payloads: list[dict[str, Any]], final: dict[str, Any]) -> None:
    """Output items come one after another, in output order, each from `output_item.added` to
    `output_item.done`; in between, a message's content part is added, its deltas add up to
    its text, and the part is done; the `.done` copies are the final response's items."""
    added = [i for i, p in enumerate(payloads) if p["type"] == "response.output_item.added"]
    done = [i for i, p in enumerate(payloads) if p["type"] == "response.output_item.done"]
    assert len(added) == len(done) == len(final["output"])
    for index, item in enumerate(final["output"]):
        first, last = payloads[added[index]], payloads[done[index]]
        assert first["output_index"] == last["output_index"] == index
        assert first["item"]["id"] == item["id"] and last["item"] == item
        inner = payloads[added[index] + 1 : done[index]]
        if item["type"] == "reasoning":
            assert first["item"]["encrypted_content"] is None  # only the .done copy is whole
            assert inner == []
            continue
        assert first["item"]["content"] == [] and first["item"]["status"] == "in_progress"
        part, text = item["content"][0], item["content"][0]["text"]
        deltas = [p["delta"] for p in inner[1:-2]]
        assert [p["type"] for p in inner] == [
            "response.content_part.added",
            *["response.output_text.delta"] * len(deltas),
            "response.output_text.done",
            "response.content_part.done",
        ]
        assert all(p["item_id"] == item["id"] and p["output_index"] == index for p in inner)
        assert inner[0]["part"] == {**part, "text": ""}
        assert "".join(deltas) == text and all(deltas)
        assert inner[-2]["text"] == text and inner[-1]["part"] == part
    assert added == sorted(added) and all(d < a for d, a in zip(done, added[1:], strict=False))


@pytest.mark.parametrize("name", ERRORS)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_error_bodies_are_sdk_error_objects(
    fake_api_client: tuple[FakeResponsesAPI, httpx.AsyncClient], name: str, stream: bool
) -> None:
    api, http = fake_api_client
    script = ERRORS[name]
    api.then(script)
    answer = await http.post(URL, json=request(stream=stream))
    assert answer.status_code == script.http_status
    body = answer.json()
    assert set(body) == {"error"}
    error = ErrorObject.model_validate(body["error"])
    assert_exact(error, body["error"])
    assert error.code == script.error_code


async def test_the_fake_records_each_call(
    fake_api_client: tuple[FakeResponsesAPI, httpx.AsyncClient],
) -> None:
    api, http = fake_api_client
    await http.post(URL, json=request(stream=False), headers={"Authorization": "Bearer k"})
    assert api.methods == ["POST"]
    assert api.urls == [URL]
    assert api.requests == [request(stream=False)]
    assert api.headers[0]["authorization"] == "Bearer k"
