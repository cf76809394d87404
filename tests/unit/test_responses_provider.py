"""ResponsesProvider against the fake Responses API (httpx.MockTransport), JSON and streamed.

Covers the request it sends, how it reads a reply, and how every provider outcome maps to a
domain error (CONTRACT.md, "What commits"). No database needed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest

from service.app import build_endpoint
from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    InvalidEncryptedContent,
    RateLimited,
    TurnstoreError,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.model import Origin, key_id
from service.platform.settings import Settings
from service.providers.base import ItemDone, ProviderEvent, ProviderRequest, Reply, TextDelta
from service.providers.openai_responses import Endpoint, ResponsesProvider
from service.providers.wire import WireLimits
from tests.support.fakeapi import (
    FakeResponsesAPI,
    Script,
    openai_id,
    output_items,
    response_object,
    stream_events,
)

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
URL = "https://fake.invalid/v1/responses"

# Replay items as a conversation stores them (odd spacing and key order included), then the
# new user input item: all must reach the provider JSON-equal and in this order.
INPUT = [
    b'{"type":"message","role":"user","content":[{"type":"input_text","text":"first"}]}',
    b'{"id": "rs_0", "type": "reasoning", "summary": [], "encrypted_content": "gAAA-old=="}',
    b'{"type":"message","role":"assistant","id":"msg_0","status":"completed",'
    b'"content":[{"type":"output_text","text":"answer","annotations":[]}]}',
    b'{"type":"function_call","id":"fc_0","call_id":"call_0","name":"lookup","arguments":"{}"}',
    b'{"type":"function_call_output","call_id":"call_0","output":"{\\"status\\": \\"OK\\"}"}',
    b'{"type":"message","role":"user","content":[{"type":"input_text","text":"second \\u00e9"}]}',
]
REQUEST = ProviderRequest([msgspec.Raw(item) for item in INPUT])


async def collect(
    provider: ResponsesProvider, *, stream: bool, request: ProviderRequest = REQUEST
) -> list[ProviderEvent]:
    try:
        return [event async for event in provider.respond(request, stream=stream)]
    finally:
        await provider.close()


async def run(*scripts: Script, stream: bool, **options: Any) -> list[ProviderEvent]:
    return await collect(FakeResponsesAPI().then(*scripts).provider(**options), stream=stream)


async def reply_of(*scripts: Script, stream: bool, **options: Any) -> Reply:
    events = await run(*scripts, stream=stream, **options)
    assert isinstance(events[-1], Reply)
    assert not any(isinstance(event, Reply) for event in events[:-1])
    return events[-1]


async def failure(
    api: FakeResponsesAPI, expected: type[TurnstoreError], *, stream: bool, **options: Any
) -> TurnstoreError:
    with pytest.raises(expected) as raised:
        await collect(api.provider(**options), stream=stream)
    assert type(raised.value) is expected  # not a subclass standing in for another code
    return raised.value


async def until_failure(
    provider: ResponsesProvider, expected: type[TurnstoreError]
) -> list[ProviderEvent]:
    """The events a streamed call yields before it fails with ``expected``."""
    received: list[ProviderEvent] = []
    with pytest.raises(expected):
        try:
            async for event in provider.respond(REQUEST, stream=True):
                received.append(event)
        finally:
            await provider.close()
    return received


def items(reply: Reply) -> list[Any]:
    return [json.loads(bytes(item)) for item in reply.output_items]


def sse(*events: dict[str, Any]) -> bytes:
    """A raw event-stream body; sequence numbers are filled in."""
    numbered = [{**event, "sequence_number": n} for n, event in enumerate(events)]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in numbered)


def whole_stream(text: str = "chunked reply") -> bytes:
    """What the fake streams for one call, as one body."""
    script = Script(text=text)
    items_ = output_items(1, text, reasoning=True)
    events = stream_events(response_object(1, script, items_), items_, text, script)
    return b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in events)


class Feed(httpx.AsyncByteStream):
    """A streamed body from any (even endless) iterator of chunks, counting the chunks sent."""

    GIVE_UP = 10_000  # an endless feed ends here, so a provider that never stops fails, not hangs

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in itertools.islice(self.chunks, self.GIVE_UP):
            self.sent += 1
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


def feeding(
    feed: Feed, *, max_body_bytes: int = 262_144, max_wire_bytes: int | None = None
) -> ResponsesProvider:
    """A provider whose every call streams ``feed``."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=feed)

    endpoint = Endpoint("openai", URL, {"Authorization": "Bearer sk-test"}, "gpt-test")
    limits = WireLimits(1.0, 5.0, max_body_bytes, max_wire_bytes)
    return ResponsesProvider(endpoint, limits, transport=httpx.MockTransport(handler))


# --- the request --------------------------------------------------------------------------


@STREAM
async def test_request_shape_openai(stream: bool) -> None:
    api = FakeResponsesAPI()
    await collect(api.provider(), stream=stream)
    assert api.methods == ["POST"]
    assert api.urls == [URL]
    assert api.headers[0]["authorization"] == "Bearer sk-test"
    assert api.headers[0]["content-type"] == "application/json"
    assert "api-key" not in api.headers[0]
    assert api.requests == [
        {
            "model": "gpt-test",
            "input": [json.loads(item) for item in INPUT],
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "stream": stream,
        }
    ]  # no instructions key when there are none


@STREAM
async def test_instructions_are_sent_when_given(stream: bool) -> None:
    api = FakeResponsesAPI()
    request = ProviderRequest(REQUEST.input_items, instructions="Be brief.")
    await collect(api.provider(), stream=stream, request=request)
    assert api.requests[0]["instructions"] == "Be brief."
    assert api.requests[0]["input"] == [json.loads(item) for item in INPUT]


@STREAM
async def test_request_shape_azure(stream: bool) -> None:
    api = FakeResponsesAPI()
    settings = Settings(
        llm_provider="azure",
        azure_endpoint="https://my-resource.openai.azure.com/",
        azure_api_key="az-key-123",
        azure_deployment="my-gpt-deployment",
    )
    limits = WireLimits(1.0, 5.0, 262_144)
    provider = ResponsesProvider(
        build_endpoint(settings), limits, transport=httpx.MockTransport(api.handle)
    )
    assert provider.endpoint.name == "azure"
    assert provider.origin == Origin(
        "azure", "https://my-resource.openai.azure.com/openai/v1/responses", "my-gpt-deployment"
    )
    assert provider.origin.kind == "azure"
    assert provider.origin.key_fingerprint == key_id("az-key-123")
    reply = (await collect(provider, stream=stream))[-1]
    assert isinstance(reply, Reply) and reply.text == "reply 1"
    assert api.methods == ["POST"]
    assert api.urls == ["https://my-resource.openai.azure.com/openai/v1/responses"]
    assert api.headers[0]["api-key"] == "az-key-123"
    assert "authorization" not in api.headers[0]
    assert api.requests[0]["model"] == "my-gpt-deployment"
    assert api.requests[0]["store"] is False
    assert api.requests[0]["include"] == ["reasoning.encrypted_content"]
    assert api.requests[0]["stream"] is stream


async def test_origin_names_provider_endpoint_and_model_without_credentials() -> None:
    api = FakeResponsesAPI()
    provider = api.provider()
    assert provider.origin == Origin("openai", URL, "gpt-test")
    assert (provider.origin.kind, provider.origin.key_fingerprint) == ("openai", key_id("sk-test"))
    await provider.close()
    endpoint = Endpoint.openai("https://user:pw@proxy.example/v1", None, "m")
    provider = ResponsesProvider(endpoint, WireLimits(1.0, 1.0, 1))
    assert provider.origin == Origin("openai", "https://proxy.example/v1/responses", "m")
    assert provider.origin.key_fingerprint is None  # a server without a key
    await provider.close()


def test_openai_endpoint_from_settings() -> None:
    settings = Settings(
        llm_provider="openai",
        openai_base_url="https://proxy.example/v1/",
        openai_api_key="sk-abc",
        openai_model="gpt-x",
    )
    endpoint = build_endpoint(settings)
    assert (endpoint.name, endpoint.url, endpoint.model) == (
        "openai",
        "https://proxy.example/v1/responses",
        "gpt-x",
    )
    assert endpoint.headers == {"Authorization": "Bearer sk-abc"}
    assert "sk-abc" not in repr(endpoint)  # the key stays out of logs
    default = Settings(llm_provider="openai", openai_api_key="k", openai_model="m")
    assert build_endpoint(default).url == "https://api.openai.com/v1/responses"


@pytest.mark.parametrize(
    "settings",
    [
        Settings(llm_provider="openai", openai_model="m"),
        Settings(llm_provider="openai", openai_api_key="k"),
        Settings(llm_provider="azure", azure_endpoint="https://a", azure_api_key="k"),
    ],
)
def test_incomplete_settings_are_refused(settings: Settings) -> None:
    with pytest.raises(ValueError):
        build_endpoint(settings)


# --- the reply ----------------------------------------------------------------------------


@STREAM
async def test_reply_text_status_and_items(stream: bool) -> None:
    events = await run(Script(text="Hello there, world!", deltas=4), stream=stream)
    reply = events[-1]
    assert isinstance(reply, Reply)
    assert (reply.text, reply.status, reply.incomplete_reason) == (
        "Hello there, world!",
        "completed",
        None,
    )
    assert items(reply) == output_items(1, "Hello there, world!", reasoning=True)
    reasoning = items(reply)[0]
    assert reasoning == {
        "id": openai_id("rs", 1),
        "type": "reasoning",
        "summary": [],
        "encrypted_content": "gAAA-sealed-1==",
    }  # whole: from response.output_item.done when streaming, not the .added copy
    deltas = events[:-1]
    if stream:
        # The reasoning item first, whole, as the API finishes it: before the message's text.
        announced, *deltas = deltas
        assert isinstance(announced, ItemDone) and json.loads(bytes(announced.item)) == reasoning
        assert all(isinstance(event, TextDelta) for event in deltas)
        assert len(deltas) == 4
        assert "".join(event.text for event in deltas if isinstance(event, TextDelta)) == reply.text
    else:
        assert deltas == []


@STREAM
async def test_reply_without_reasoning_or_without_text(stream: bool) -> None:
    reply = await reply_of(Script(text="no reasoning", reasoning=False), stream=stream)
    assert [item["type"] for item in items(reply)] == ["message"]
    reply = await reply_of(Script(text="", reasoning=True), stream=stream)
    assert (reply.text, reply.status) == ("", "completed")  # the use case refuses empty text
    assert [item["type"] for item in items(reply)] == ["reasoning"]


async def test_streamed_items_are_the_done_copies() -> None:
    text = "partial"
    message = output_items(1, text, reasoning=False)[0]
    body = sse(
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**message, "content": []},
        },
        {
            "type": "response.output_text.delta",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": text,
            "logprobs": [],
        },
        {"type": "response.output_item.done", "output_index": 0, "item": message},
        # The terminal event's output is not what is kept: the .done copies are.
        {"type": "response.completed", "response": {"status": "completed", "output": []}},
    )
    reply = await reply_of(Script(raw_body=body), stream=True)
    assert items(reply) == [message]
    assert reply.text == text


@STREAM
@pytest.mark.parametrize("reason", ["max_output_tokens", "content_filter"])
async def test_incomplete_is_a_reply(stream: bool, reason: str) -> None:
    """The use case decides: commit max_output_tokens, refuse content_filter."""
    script = Script(text="cut off", status="incomplete", incomplete_reason=reason)
    reply = await reply_of(script, stream=stream)
    assert (reply.text, reply.status, reply.incomplete_reason) == ("cut off", "incomplete", reason)
    assert [item["type"] for item in items(reply)] == ["reasoning", "message"]


@STREAM
@pytest.mark.parametrize("reason", [None, "max_messages"])
async def test_incomplete_for_another_reason_is_an_upstream_error(
    stream: bool, reason: str | None
) -> None:
    api = FakeResponsesAPI().then(Script(status="incomplete", incomplete_reason=reason))
    await failure(api, UpstreamError, stream=stream)


# --- HTTP errors --------------------------------------------------------------------------


@STREAM
async def test_429_is_rate_limited_with_retry_after(stream: bool) -> None:
    api = FakeResponsesAPI().then(
        Script(http_status=429, error_code="rate_limit_exceeded", headers={"Retry-After": "7"}),
        Script(http_status=429, error_code="rate_limit_exceeded"),
    )
    first = await failure(api, RateLimited, stream=stream)
    assert isinstance(first, RateLimited) and first.retry_after == "7"
    second = await failure(api, RateLimited, stream=stream)
    assert isinstance(second, RateLimited) and second.retry_after is None


@pytest.mark.parametrize(
    ("header", "passed_on"),
    [
        ("0", "0"),
        (" 120 ", "120"),
        ("Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2015 07:28:00 GMT"),
        ("", None),
        ("-1", None),
        ("1.5", None),
        ("soon", None),
        ("7; <script>", None),
        ("9" * 100, None),
    ],
)
async def test_only_a_plain_retry_after_is_passed_on(header: str, passed_on: str | None) -> None:
    api = FakeResponsesAPI().then(Script(http_status=429, headers={"Retry-After": header}))
    error = await failure(api, RateLimited, stream=False)
    assert isinstance(error, RateLimited) and error.retry_after == passed_on


@STREAM
async def test_400_context_length_exceeded(stream: bool) -> None:
    api = FakeResponsesAPI().then(Script(http_status=400, error_code="context_length_exceeded"))
    await failure(api, ContextLengthExceeded, stream=stream)


AZURE_FILTERED = json.dumps(
    {
        "error": {
            "message": "The response was filtered due to the prompt triggering content policy.",
            "type": None,
            "param": "prompt",
            "code": "content_filter",
            "status": 400,
            "innererror": {
                "code": "ResponsibleAIPolicyViolation",
                "content_filter_result": {"hate": {"filtered": True, "severity": "high"}},
            },
        }
    }
).encode()


@STREAM
async def test_400_content_filter_azure(stream: bool) -> None:
    api = FakeResponsesAPI().then(Script(http_status=400, raw_body=AZURE_FILTERED))
    await failure(api, ContentFiltered, stream=stream)


@STREAM
async def test_400_invalid_encrypted_content(stream: bool) -> None:
    """Replayed reasoning the provider cannot open: the use case retries once without it."""
    api = FakeResponsesAPI().then(Script(http_status=400, error_code="invalid_encrypted_content"))
    await failure(api, InvalidEncryptedContent, stream=stream)
    assert len(api.requests) == 1  # the adapter itself does not retry


@STREAM
@pytest.mark.parametrize(
    "script",
    [
        Script(http_status=400, error_code="invalid_value"),
        Script(http_status=400),
        Script(http_status=400, raw_body=b"<html>Bad Request</html>"),
        Script(http_status=400, raw_body=b'{"error": "context_length_exceeded"}'),
        Script(http_status=401, error_code="invalid_api_key"),
        Script(http_status=403),
        Script(http_status=404, error_code="context_length_exceeded"),
        Script(http_status=413, raw_body=b""),
        Script(http_status=500, error_code="server_error"),
        Script(http_status=502, raw_body=b"bad gateway"),
        Script(http_status=503, error_code="content_filter"),
        Script(http_status=307, headers={"Location": "https://elsewhere.invalid/"}, raw_body=b""),
        Script(http_status=204, raw_body=b""),
    ],
    ids=lambda script: f"{script.http_status}-{script.error_code or 'raw'}",
)
async def test_other_statuses_are_upstream_errors(stream: bool, script: Script) -> None:
    api = FakeResponsesAPI().then(script)
    await failure(api, UpstreamError, stream=stream)
    assert len(api.requests) == 1  # a redirect is not followed


# --- unusable bodies ----------------------------------------------------------------------


@STREAM
async def test_failed_status_is_an_upstream_error(stream: bool) -> None:
    await failure(FakeResponsesAPI().then(Script(status="failed")), UpstreamError, stream=stream)


MALFORMED_JSON = [
    b'{"status": "completed", "output": [',
    b"",
    b"not json at all",
    b'["a", "list"]',
    b'{"status": "completed", "output": "not a list"}',
    b'{"status": "completed", "output": [{"type": "message", "content": "not a list"}]}',
    b'{"status": "completed", "output": [], "incomplete_details": 5}',
    b'{"status": "in_progress", "output": []}',
    b'{"status": "completed", "output": [1, 2]}',
]
MALFORMED_STREAM = [
    b"data: {not json\n\n",
    b'data: {"type": "response.output_text.delta", "delta": 5}\n\n',
    b'data: {"type": "response.completed", "response": {"status": "completed", "output": "x"}}\n\n',
    b'data: {"type": "response.completed"}\n\n',
    b'data: {"no": "type"}\n\n',
    b"data: \xff\xfe\n\n",
    b"",
    b'{"status": "completed", "output": []}',  # a JSON body where a stream was asked for
]


@pytest.mark.parametrize("body", MALFORMED_JSON)
async def test_malformed_json_body_is_an_upstream_error(body: bytes) -> None:
    await failure(FakeResponsesAPI().then(Script(raw_body=body)), UpstreamError, stream=False)


@pytest.mark.parametrize("body", MALFORMED_STREAM)
async def test_malformed_stream_is_an_upstream_error(body: bytes) -> None:
    await failure(FakeResponsesAPI().then(Script(raw_body=body)), UpstreamError, stream=True)


@STREAM
async def test_body_over_the_limit_is_an_upstream_error(stream: bool) -> None:
    api = FakeResponsesAPI().then(Script(text="x" * 5000, deltas=50))
    await failure(api, UpstreamError, stream=stream, max_body_bytes=4000)
    # The same reply fits a larger limit.
    reply = await reply_of(Script(text="x" * 5000, deltas=50), stream=stream, max_body_bytes=40_000)
    assert reply.text == "x" * 5000


@STREAM
async def test_the_limit_bounds_the_reply_not_the_wire(stream: bool) -> None:
    """A stream repeats its text about five times: the same reply fits in both modes."""
    text = "y" * 200_000  # with the default limit (262,144) a stream used to stop near 45 KB
    reply = await reply_of(Script(text=text, deltas=400), stream=stream, max_body_bytes=262_144)
    assert reply.text == text
    too_long = Script(text="y" * 270_000, deltas=400)
    await failure(FakeResponsesAPI().then(too_long), UpstreamError, stream=stream)


def endless_deltas() -> Iterator[bytes]:
    event = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0}
    for n in itertools.count():
        yield f"data: {json.dumps({**event, 'delta': 'la ', 'sequence_number': n})}\n\n".encode()


def endless_line() -> Iterator[bytes]:
    yield b'data: {"type": "response.output_text.delta", "delta": "'
    while True:
        yield b"la " * 100  # one line that never ends


@pytest.mark.parametrize(
    ("chunks", "most"),
    [(endless_deltas, 1_010), (endless_line, 110)],  # 3 bytes of text / 300 bytes a chunk
)
async def test_an_endless_stream_is_cut_off_while_reading(chunks: Any, most: int) -> None:
    """By the reply limit (3,000 bytes of text), or by the wire cap (30,000 bytes) when no
    event ever ends."""
    feed = Feed(chunks())
    provider = feeding(feed, max_body_bytes=3_000, max_wire_bytes=30_000)
    received = await until_failure(provider, UpstreamError)
    assert 0 < feed.sent < most  # stopped right after the limit, not at the end (there is none)
    assert feed.closed
    assert all(isinstance(event, TextDelta) for event in received)


async def test_a_stream_may_arrive_in_any_chunks() -> None:
    body = whole_stream("a reply in small pieces").replace(b"\n", b"\r\n")  # CRLF too
    feed = Feed(body[i : i + 7] for i in range(0, len(body), 7))
    events = await collect(feeding(feed), stream=True)
    reply = events[-1]
    assert isinstance(reply, Reply) and reply.text == "a reply in small pieces"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply.text
    assert items(reply) == output_items(1, "a reply in small pieces", reasoning=True)


async def test_unknown_events_comments_and_multiline_data_are_tolerated() -> None:
    text = "fine"
    message = output_items(1, text, reasoning=False)[0]
    body = (
        b": keep-alive comment\n\nretry: 1000\n\n"
        + sse(
            # Event types the adapter has no use for, with fields of other shapes.
            {
                "type": "response.shell_call_output_content.delta",
                "item_id": "sh_1",
                "output_index": 0,
                "delta": {"stdout": "x"},
            },
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": "rs_1",
                "output_index": 0,
                "summary_index": 0,
                "delta": "hm",
            },
            {
                "type": "response.brand_new_event",
                "code": 7,
                "error": "no",
                "item": 1,
                "response": [],
            },
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": "",
                "logprobs": [],
            },
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            },
            {"type": "response.output_item.done", "output_index": 0, "item": message},
        )
        + b'data: {"type": "response.completed",\ndata:  "response": {"status": "completed"}}\n\n'
        + b"data: trailing garbage after the terminal event is never read\n\n"
    )
    events = await run(Script(raw_body=body), stream=True)
    assert [e.text for e in events[:-1]] == [text]  # type: ignore[union-attr]  # empty deltas are dropped
    reply = events[-1]
    assert isinstance(reply, Reply) and items(reply) == [message] and reply.text == text


@STREAM
async def test_a_message_with_a_refusal_part_gives_its_text_only(stream: bool) -> None:
    message = {
        "id": "msg_9", "type": "message", "role": "assistant", "status": "completed",
        "content": [
            {"type": "output_text", "text": "Half", "annotations": []},
            {"type": "refusal", "refusal": "I can't help with that."},
            {"type": "output_text", "text": " and half", "annotations": []},
        ],
    }  # fmt: skip
    response = {"status": "completed", "output": [message]}
    if stream:
        body = sse(
            {"type": "response.output_item.done", "output_index": 0, "item": message},
            {"type": "response.completed", "response": response},
        )
    else:
        body = json.dumps(response).encode()
    reply = await reply_of(Script(raw_body=body), stream=stream)
    assert reply.text == "Half and half"
    assert items(reply) == [message]


# --- streams that go wrong ----------------------------------------------------------------


async def test_a_stream_without_terminal_event_is_an_upstream_error() -> None:
    await failure(FakeResponsesAPI().then(Script(break_stream=True)), UpstreamError, stream=True)


async def test_a_stream_cut_mid_event_is_an_upstream_error() -> None:
    body = whole_stream()
    cut = body[: body.rindex(b"\n\n", 0, len(body) - 2) + 2] + b'data: {"type": "response.compl'
    await failure(FakeResponsesAPI().then(Script(raw_body=cut)), UpstreamError, stream=True)
    unterminated = body.removesuffix(b"\n\n")  # the terminal event is never dispatched
    await failure(
        FakeResponsesAPI().then(Script(raw_body=unterminated)), UpstreamError, stream=True
    )


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("context_length_exceeded", ContextLengthExceeded),
        ("content_filter", ContentFiltered),
        ("rate_limit_exceeded", RateLimited),
        ("invalid_encrypted_content", InvalidEncryptedContent),
        ("server_error", UpstreamError),
        (None, UpstreamError),
    ],
)
async def test_a_stream_error_event_maps_its_code(
    code: str | None, expected: type[TurnstoreError]
) -> None:
    event = {"type": "error", "code": code, "message": "upstream says no", "param": None}
    await failure(FakeResponsesAPI().then(Script(raw_body=sse(event))), expected, stream=True)
    if code is not None:  # and as the fake sends it, after the output items
        await failure(FakeResponsesAPI().then(Script(error_code=code)), expected, stream=True)


async def test_a_stream_error_event_with_a_nested_error_object() -> None:
    event = {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
            "message": "too long",
        },
    }
    api = FakeResponsesAPI().then(Script(raw_body=sse(event)))
    await failure(api, ContextLengthExceeded, stream=True)


async def test_a_stream_error_after_deltas_still_fails_the_call() -> None:
    api = FakeResponsesAPI()
    provider = api.then(Script(text="some text", error_code="context_length_exceeded")).provider()
    received = await until_failure(provider, ContextLengthExceeded)
    assert "".join(e.text for e in received if isinstance(e, TextDelta)) == "some text"


# --- transport failures -------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    "exception",
    [
        httpx.ConnectTimeout("connect timed out"),
        httpx.ReadTimeout("read timed out"),
        httpx.WriteTimeout("write timed out"),
        httpx.PoolTimeout("no connection free"),
    ],
    ids=lambda exception: type(exception).__name__,
)
async def test_timeouts_are_upstream_timeouts_and_not_retried(
    stream: bool, exception: Exception
) -> None:
    api = FakeResponsesAPI().then(Script(exception=exception), Script())
    error = await failure(api, UpstreamTimeout, stream=stream)
    assert len(api.requests) == 1  # no retry: the provider may have done (and billed) the work
    assert error.__cause__ is exception


@STREAM
@pytest.mark.parametrize(
    "exception",
    [
        httpx.ConnectError("connection refused"),
        httpx.RemoteProtocolError("peer closed connection without sending complete message"),
        httpx.ReadError("connection reset"),
        httpx.ProxyError("proxy says no"),
        httpx.UnsupportedProtocol("no"),
        httpx.DecodingError("bad gzip"),
    ],
    ids=lambda exception: type(exception).__name__,
)
async def test_transport_errors_are_upstream_errors(stream: bool, exception: Exception) -> None:
    api = FakeResponsesAPI().then(Script(exception=exception), Script())
    await failure(api, UpstreamError, stream=stream)
    assert len(api.requests) == 1


def dying_stream(exception: Exception) -> Iterator[bytes]:
    """The fake's stream up to its first text delta, then the connection fails."""
    for event in whole_stream("first then nothing").split(b"\n\n"):
        yield event + b"\n\n"
        if b"response.output_text.delta" in event:
            raise exception


@pytest.mark.parametrize(
    ("exception", "expected"),
    [
        (httpx.ReadTimeout("read timed out"), UpstreamTimeout),
        (httpx.RemoteProtocolError("incomplete chunked read"), UpstreamError),
    ],
)
async def test_a_stream_that_breaks_off_after_a_delta(
    exception: Exception, expected: type[TurnstoreError]
) -> None:
    feed = Feed(dying_stream(exception))
    provider = feeding(feed)
    received = await until_failure(provider, expected)
    assert any(isinstance(event, TextDelta) for event in received)
    assert all(isinstance(event, ItemDone | TextDelta) for event in received)
    assert feed.closed


# --- closing early ------------------------------------------------------------------------


async def test_closing_the_events_early_closes_the_upstream_stream() -> None:
    script = Script(text="a long answer in many deltas", deltas=10)
    provider = FakeResponsesAPI().then(script).provider()
    events = provider.respond(REQUEST, stream=True)
    try:
        first = await anext(events)
        assert isinstance(first, ItemDone)  # the reasoning item, announced before the text
        assert not script.closed.is_set()
        await events.aclose()
        assert script.closed.is_set()
    finally:
        await provider.close()


async def test_cancelling_a_stalled_call_closes_the_upstream_stream() -> None:
    """What a client disconnect does: the server cancels the task reading the events."""
    script = Script(text="one two three", deltas=3, stall=asyncio.Event())
    provider = FakeResponsesAPI().then(script).provider()
    received: list[ProviderEvent] = []
    first_delta = asyncio.Event()

    async def consume() -> None:
        async for event in provider.respond(REQUEST, stream=True):
            received.append(event)
            if isinstance(event, TextDelta):
                first_delta.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(first_delta.wait(), timeout=5)
        await asyncio.sleep(0.01)  # the provider is now waiting for the stalled upstream
        texts = [e.text for e in received if isinstance(e, TextDelta)]
        assert texts == ["one t"] and not script.closed.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert script.closed.is_set()
    finally:
        await provider.close()


async def test_a_finished_stream_is_closed() -> None:
    script = Script()
    await run(script, stream=True)
    assert script.closed.is_set()


# --- nothing secret leaks -----------------------------------------------------------------

SECRET = "sk-live-SECRET-0123456789"
LEAKY = [
    Script(
        http_status=500, raw_body=f'{{"error": {{"message": "db password {SECRET}"}}}}'.encode()
    ),
    Script(
        http_status=400,
        raw_body=f'{{"error": {{"message": "{SECRET}", "code": "{SECRET}"}}}}'.encode(),
    ),
    Script(http_status=429, raw_body=SECRET.encode(), headers={"Retry-After": SECRET}),
    Script(raw_body=f'{{"status": "{SECRET}", "output": []}}'.encode()),
    Script(
        raw_body=f'{{"status": "incomplete", "incomplete_details": {{"reason": "{SECRET}"}}}}'.encode()
    ),
    Script(raw_body=f"data: {SECRET}\n\n".encode()),
    Script(raw_body=sse({"type": "error", "code": SECRET, "message": SECRET, "param": SECRET})),
    Script(
        raw_body=sse(
            {
                "type": "response.failed",
                "response": {
                    "status": "failed",
                    "error": {"code": "server_error", "message": SECRET},
                },
            }
        )
    ),
    Script(exception=httpx.ReadTimeout(SECRET)),
    Script(exception=httpx.ConnectError(SECRET)),
]


@STREAM
@pytest.mark.parametrize("script", LEAKY, ids=range(len(LEAKY)))
async def test_errors_never_carry_provider_text_or_the_key(stream: bool, script: Script) -> None:
    api = FakeResponsesAPI().then(script)
    with pytest.raises(TurnstoreError) as raised:
        await collect(api.provider(), stream=stream)
    error = raised.value
    for shown in (str(error), repr(error), error.message, str(getattr(error, "retry_after", ""))):
        assert SECRET not in shown
        assert "sk-test" not in shown
        assert "upstream says no" not in shown
