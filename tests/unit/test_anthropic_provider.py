"""AnthropicProvider against the strict fake Messages API (tests/support/fake_anthropic.py),
whole and streamed.

The fake refuses what the real API refuses: any byte changed in a replayed thinking block, a
final tool_use turn without thinking while thinking is on, an unknown field, a fifth cache
breakpoint. So a conversation it accepts turn after turn is one the real API would accept.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import msgspec
import pytest

from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    InvalidEncryptedContent,
    InvalidInput,
    ProviderRefused,
    RateLimited,
    TurnstoreError,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.model import Origin, key_id
from service.core.usage import Usage
from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.anthropic_request import messages_body
from service.providers.base import ItemDone, ProviderEvent, ProviderRequest, Reply, TextDelta
from service.providers.wire import WireLimits
from tests.support.fake_anthropic import (
    API_KEY,
    FakeMessagesAPI,
    Redacted,
    Script,
    Text,
    Thinking,
    ToolUse,
)

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
BASE = "https://fake.invalid"
THINK = {"reasoning": msgspec.Raw(b'{"effort":"low"}')}
# A system prompt long enough to be cached (the fake, as the real API, caches >= 1024 tokens).
INSTRUCTIONS = "You are a careful assistant. Answer briefly and cite the tool's results. " * 70


def user(text: str) -> msgspec.Raw:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return msgspec.Raw(msgspec.json.encode(item))


def output_of(call_id: str, output: str) -> msgspec.Raw:
    item = {"type": "function_call_output", "call_id": call_id, "output": output}
    return msgspec.Raw(msgspec.json.encode(item))


def provider(api: FakeMessagesAPI, **options: Any) -> AnthropicProvider:
    transport = options.pop("transport", httpx.MockTransport(api.handle))
    key = options.pop("api_key", API_KEY)
    endpoint = AnthropicEndpoint("anthropic", options.pop("base_url", BASE), key, "claude-test")
    max_tokens = options.pop("max_tokens", 8192)
    limits = WireLimits(
        **({"connect_timeout_s": 1.0, "read_timeout_s": 1.0, "max_body_bytes": 1 << 20} | options)
    )
    return AnthropicProvider(endpoint, limits, max_tokens=max_tokens, transport=transport)


async def events_of(
    api: FakeMessagesAPI, request: ProviderRequest, *, stream: bool, **options: Any
) -> list[ProviderEvent]:
    llm = provider(api, **options)
    try:
        return [event async for event in llm.respond(request, stream=stream)]
    finally:
        await llm.close()


async def reply_of(
    api: FakeMessagesAPI, request: ProviderRequest, *, stream: bool, **options: Any
) -> Reply:
    events = await events_of(api, request, stream=stream, **options)
    assert isinstance(events[-1], Reply)
    assert not any(isinstance(event, Reply) for event in events[:-1])
    return events[-1]


def blocks(reply: Reply) -> list[dict[str, Any]]:
    return [json.loads(bytes(item)) for item in reply.output_items]


def hi(**fields: Any) -> ProviderRequest:
    raw = {name: msgspec.Raw(json.dumps(value).encode()) for name, value in fields.items()}
    return ProviderRequest([user("hi")], fields=raw)


# -- a long conversation with thinking and tools -----------------------------------------------


def script_of(turn: int) -> list[Script]:
    """Turn ``turn``'s replies: every third turn a tool round first, each reply with several
    thinking blocks (one empty but signed), redacted thinking, non-ASCII and newlines."""
    answer = Script(
        blocks=[
            Thinking(f"weighing turn {turn}\n- é ✓"),
            Redacted(f"hidden {turn}"),
            Thinking(""),
            Text(f"reply {turn}: naïve\n"),
            Text("and a second text block"),
        ],
        deltas=4,
    )
    if turn % 3:
        return [answer]
    call = Script(
        blocks=[
            Thinking(f"plan {turn}"),
            Thinking(""),
            ToolUse("lookup", {"q": f"é {turn}", "n": [turn, 2.5], "deep": {"ok": True}}),
            ToolUse("clock"),
        ]
    )
    return [call, answer]


@dataclass
class Conversation:
    """Each request sends the earlier turns' items back: the user item, each reply's output
    items, and the tool results as Responses items."""

    stream: bool | None  # None: turns alternate (even turns streamed)
    api: FakeMessagesAPI = field(default_factory=FakeMessagesAPI)
    history: list[msgspec.Raw] = field(default_factory=list)
    replies: list[list[Reply]] = field(default_factory=list)  # per turn, per request
    streamed: list[list[ProviderEvent]] = field(default_factory=list)

    async def run(self, turns: int) -> None:
        llm = provider(self.api)
        try:
            for turn in range(1, turns + 1):
                scripts = script_of(turn)
                self.api.then(*scripts)
                stream = turn % 2 == 0 if self.stream is None else self.stream
                self.history.append(user(f"question {turn}"))
                self.replies.append([])
                for _ in scripts:
                    request = ProviderRequest(list(self.history), INSTRUCTIONS, fields=THINK)
                    events = [e async for e in llm.respond(request, stream=stream)]
                    self.streamed.append(events)
                    reply = events[-1]
                    assert isinstance(reply, Reply) and reply.status == "completed"
                    self.replies[-1].append(reply)
                    self.history += reply.output_items
                    calls = [b for b in blocks(reply) if b["type"] == "tool_use"]
                    self.history += [output_of(c["id"], f"result of {c['name']}") for c in calls]
        finally:
            await llm.close()


async def test_a_20_turn_conversation_with_thinking_and_tools_replays_byte_for_byte() -> None:
    conversation = Conversation(stream=None)
    await conversation.run(20)
    assert len(conversation.replies) == 20 and len(conversation.api.requests) == 26
    # What was sent back each time is what came: each block the fake issued, at its place.
    for turn, replies in enumerate(conversation.replies, 1):
        for reply, script in zip(replies, script_of(turn), strict=True):
            assert script.blocks is not None
            kinds = {Text: "text", Thinking: "thinking", Redacted: "redacted_thinking"}
            expected = [kinds.get(type(b), "tool_use") for b in script.blocks]
            assert [b["type"] for b in blocks(reply)] == expected
        assert replies[-1].text == f"reply {turn}: naïve\nand a second text block"
    last = conversation.api.bodies[-1]
    answered = len(conversation.replies[-1][-1].output_items)
    for item in conversation.history[:-answered]:
        if b'"role"' not in bytes(item) and b"function_call_output" not in bytes(item):
            assert bytes(item) in last  # Anthropic's blocks, spliced as they came
    sent = conversation.api.requests[-1]["messages"]
    # 19 answers and 6 tool calls: consecutive blocks of one reply stay one message.
    assert sum(m["role"] == "assistant" for m in sent) == 25
    assert all(r["thinking"] == {"type": "enabled", "budget_tokens": 1024}
               for r in conversation.api.requests)  # fmt: skip


async def test_streamed_and_whole_replies_give_the_same_output_items() -> None:
    whole, streamed = Conversation(stream=False), Conversation(stream=True)
    await whole.run(6)
    await streamed.run(6)
    for sent_whole, sent_streamed in zip(whole.replies, streamed.replies, strict=True):
        for a, b in zip(sent_whole, sent_streamed, strict=True):
            assert [bytes(i) for i in a.output_items] == [bytes(i) for i in b.output_items]
            assert (a.text, a.status, a.usage) == (b.text, b.status, b.usage)
    for events in streamed.streamed:
        reply = events[-1]
        assert isinstance(reply, Reply)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert text == reply.text
        done = [bytes(e.item) for e in events if isinstance(e, ItemDone)]
        opaque = [
            bytes(i) for i in reply.output_items if "thinking" in json.loads(bytes(i))["type"]
        ]
        assert done == opaque and len(done) >= 2  # each thinking block, as it stopped


async def test_an_empty_signed_thinking_block_is_kept() -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Thinking(""), Text("ok")]))
    for stream in (False, True):
        api.then(Script(blocks=[Thinking(""), Text("ok")]))
        reply = await reply_of(api, replace(hi(), fields=THINK), stream=stream)
        first = blocks(reply)[0]
        assert first["type"] == "thinking" and first["thinking"] == "" and first["signature"]


@pytest.mark.parametrize(
    ("kind", "alter"),
    [
        ("thinking", lambda b: b.replace(b"weighing", b"Weighing")),
        ("redacted_thinking", lambda b: b[:-3] + (b"B" if b[-3:-2] != b"B" else b"C") + b[-2:]),
    ],
)
@STREAM
async def test_a_replayed_block_altered_by_one_byte_is_invalid_encrypted_content(
    kind: str, alter: Any, stream: bool
) -> None:
    conversation = Conversation(stream=False)
    await conversation.run(2)
    history = list(conversation.history)
    at = next(i for i, item in enumerate(history) if f'"type":"{kind}"'.encode() in bytes(item))
    changed = alter(bytes(history[at]))
    assert len(changed) == len(history[at]) and changed != bytes(history[at])
    history[at] = msgspec.Raw(changed)
    request = ProviderRequest([*history, user("again")], INSTRUCTIONS, fields=THINK)
    with pytest.raises(InvalidEncryptedContent):
        await reply_of(conversation.api, request, stream=stream)


# -- prompt caching ----------------------------------------------------------------------------


def shares(conversation: Conversation) -> list[float]:
    """Per request from the second on: what it read from the cache, as a share of what the
    request before it had cached (its reads and its writes)."""
    usages = [reply.usage for replies in conversation.replies for reply in replies]
    found = []
    for before, now in itertools.pairwise(usages):
        assert before is not None and now is not None
        assert before.cache_write_tokens > 0  # every request writes (the test is not vacuous)
        found.append(now.cached_tokens / (before.cached_tokens + before.cache_write_tokens))
    return found


async def test_each_request_reads_what_the_one_before_it_wrote() -> None:
    conversation = Conversation(stream=None)
    await conversation.run(20)
    found = shares(conversation)
    assert len(found) == 25 and min(found) >= 0.9
    first = conversation.replies[0][0].usage
    assert first is not None and first.cached_tokens == 0 and first.cache_write_tokens > 1024


async def test_breakpoints_mark_the_system_the_history_and_the_request_never_thinking() -> None:
    conversation = Conversation(stream=False)
    await conversation.run(4)
    for body in conversation.api.requests:
        marked = [b for m in body["messages"] for b in m["content"] if "cache_control" in b]
        assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
        assert "cache_control" not in body["system"][0] or len(body["system"]) == 1
        assert len(marked) + 1 <= 4
        assert all(b["type"] not in ("thinking", "redacted_thinking") for b in marked)
        assert body["messages"][-1]["content"][-1].get("cache_control") == {"type": "ephemeral"}
    # Turn 4's request: the end of its history is turn 3's answer (Anthropic's blocks, not
    # marked): the mark walks back to the last block built here, turn 3's tool results.
    last = conversation.api.requests[-1]["messages"]
    assert [b.get("type") for b in last[-3]["content"] if "cache_control" in b] == ["tool_result"]


def test_usage_counts_every_input_token_as_openai_does() -> None:
    from service.providers.anthropic import _Usage

    usage = _Usage(
        input_tokens=10, cache_creation_input_tokens=200, cache_read_input_tokens=3000,
        output_tokens=7,
    ).value()  # fmt: skip
    assert usage == Usage(3210, 3000, 7, 0, 3217, 200)
    assert usage.as_openai()["input_tokens_details"] == {
        "cached_tokens": 3000,
        "cache_write_tokens": 200,
    }


# -- the request -------------------------------------------------------------------------------


async def test_mapped_fields_reach_the_body() -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text('{"a": 1}')]))
    tools = [
        {"type": "function", "name": "lookup", "description": "Finds.", "strict": True,
         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
        {"type": "function", "name": "clock", "parameters": None},
    ]  # fmt: skip
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = replace(
        hi(
            temperature=0.5, top_p=0.9, max_output_tokens=2000, tool_choice="required",
            parallel_tool_calls=False, user="owner-1", metadata={"k": "v"}, store=False,
            prompt_cache_key="x", truncation="disabled", service_tier="auto",
            text={"format": {"type": "json_schema", "name": "A", "schema": schema,
                             "strict": True}},
        ),
        tools=msgspec.Raw(json.dumps(tools).encode()),
        instructions="Be brief.",
    )  # fmt: skip
    await reply_of(api, request, stream=True)
    body = api.requests[-1]
    assert body == {
        "model": "claude-test",
        "max_tokens": 2000,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        "tools": [
            {"name": "lookup", "description": "Finds.", "input_schema": tools[0]["parameters"]},
            {"name": "clock", "input_schema": {"type": "object", "properties": {}}},
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": schema}},
        "metadata": {"user_id": "owner-1"},
        "stream": True,
    }
    headers = api.headers[-1]
    assert headers["x-api-key"] == API_KEY and headers["anthropic-version"] == "2023-06-01"
    assert api.urls[-1] == f"{BASE}/v1/messages"


@pytest.mark.parametrize(
    ("choice", "sent"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ({"type": "function", "name": "lookup"}, {"type": "tool", "name": "lookup"}),
    ],
)
def test_tool_choice_is_mapped(choice: Any, sent: dict[str, str]) -> None:
    body = json.loads(messages_body(hi(tool_choice=choice), "m", max_tokens=64, stream=False))
    assert body["tool_choice"] == sent and "stream" not in body and body["max_tokens"] == 64


@pytest.mark.parametrize(
    ("effort", "limit", "budget"),
    [("low", None, 1024), ("medium", None, 4096), ("high", None, 16384), ("high", 5000, 4999)],
)
def test_reasoning_effort_is_a_thinking_budget_below_max_tokens(
    effort: str, limit: int | None, budget: int
) -> None:
    fields: dict[str, Any] = {"reasoning": {"effort": effort, "summary": "auto"}}
    if limit is not None:
        fields["max_output_tokens"] = limit
    body = json.loads(messages_body(hi(**fields), "m", max_tokens=32000, stream=False))
    assert body["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert body["max_tokens"] == (limit or 32000)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"reasoning": {"effort": "low"}, "max_output_tokens": 1000}, "max_output_tokens"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
        ({"reasoning": {"effort": "low"}, "temperature": 0.2}, "temperature"),
        ({"reasoning": {"effort": "low"}, "tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"temperature": "hot"}, "temperature"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
async def test_a_field_it_cannot_honour_is_400_with_its_param(
    fields: dict[str, Any], param: str
) -> None:
    api = FakeMessagesAPI()
    with pytest.raises(InvalidInput) as raised:
        await reply_of(api, hi(**fields), stream=False)
    assert raised.value.status == 400 and raised.value.param == param
    assert api.requests == []  # refused before any call


async def test_a_tool_that_is_not_a_function_is_400_tools() -> None:
    tools = msgspec.Raw(b'[{"type":"web_search"}]')
    with pytest.raises(InvalidInput) as raised:
        await reply_of(FakeMessagesAPI(), replace(hi(), tools=tools), stream=False)
    assert raised.value.param == "tools"


async def test_a_tool_turn_another_provider_answered_is_sent_without_thinking() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
    items = [user("look"), msgspec.Raw(json.dumps(call).encode()), output_of("call_1", "42")]
    api = FakeMessagesAPI()
    reply = await reply_of(api, ProviderRequest(items, fields=THINK), stream=False)
    assert reply.text == "reply 1" and "thinking" not in api.requests[-1]
    # The next user turn starts after a text answer: thinking is on again.
    more = [*items, *reply.output_items, user("and?")]
    await reply_of(api, ProviderRequest(more, fields=THINK), stream=False)
    assert api.requests[-1]["thinking"]["type"] == "enabled"


# -- the answer --------------------------------------------------------------------------------


@STREAM
@pytest.mark.parametrize(
    ("stop", "status", "reason"),
    [
        ("end_turn", "completed", None),
        ("stop_sequence", "completed", None),
        ("max_tokens", "incomplete", "max_output_tokens"),
    ],
)
async def test_stop_reasons(stream: bool, stop: str, status: str, reason: str | None) -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text("cut")], stop_reason=stop))
    reply = await reply_of(api, hi(), stream=stream)
    assert (reply.text, reply.status, reply.incomplete_reason) == ("cut", status, reason)


@STREAM
async def test_a_refusal_is_content_filtered(stream: bool) -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text("I can't")], stop_reason="refusal"))
    with pytest.raises(ContentFiltered):
        await reply_of(api, hi(), stream=stream)


class Rechunked(httpx.AsyncBaseTransport):
    """The fake's answers cut into ``size``-byte chunks (a real stream splits lines anywhere),
    noting when the body is closed."""

    def __init__(self, api: FakeMessagesAPI, size: int) -> None:
        self.api, self.size, self.closed, self.sent = api, size, False, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        answer = await self.api.handle(request)
        body = b"".join([chunk async for chunk in answer.aiter_raw()])
        chunks = [body[i : i + self.size] for i in range(0, len(body), self.size)]
        return httpx.Response(
            answer.status_code, headers=answer.headers, stream=_Chunks(self, chunks)
        )


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, owner: Rechunked, chunks: list[bytes]) -> None:
        self.owner, self.chunks = owner, chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.owner.sent += 1
            yield chunk

    async def aclose(self) -> None:
        self.owner.closed = True


@pytest.mark.parametrize("size", [1, 7, 4096])
async def test_a_stream_cut_anywhere_reads_the_same(size: int) -> None:
    script = script_of(3)[0]
    whole = await reply_of(
        FakeMessagesAPI().then(script), replace(hi(), fields=THINK), stream=False
    )
    api = FakeMessagesAPI().then(script)
    cut = await reply_of(
        api, replace(hi(), fields=THINK), stream=True, transport=Rechunked(api, size)
    )
    assert [bytes(i) for i in cut.output_items] == [bytes(i) for i in whole.output_items]
    assert blocks(cut)[2]["input"] == {"q": "é 3", "n": [3, 2.5], "deep": {"ok": True}}


async def test_closing_the_stream_early_closes_the_response() -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text("a long answer " * 50)], deltas=20))
    transport = Rechunked(api, 64)
    llm = provider(api, transport=transport)
    events = llm.respond(hi(), stream=True)
    assert isinstance(await anext(events), TextDelta)
    assert not transport.closed
    await events.aclose()
    assert transport.closed and transport.sent < 30
    await llm.close()


@STREAM
async def test_a_reply_over_the_body_limit_is_upstream_error(stream: bool) -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text("x" * 5000)]))
    with pytest.raises(UpstreamError):
        await reply_of(api, hi(), stream=stream, max_body_bytes=4000)


async def test_a_stream_over_the_wire_limit_is_upstream_error() -> None:
    api = FakeMessagesAPI().then(Script(blocks=[Text("x" * 3000)], deltas=300))
    with pytest.raises(UpstreamError):
        await reply_of(api, hi(), stream=True, max_body_bytes=4000, max_wire_bytes=20_000)


@pytest.mark.parametrize(
    "body",
    [
        b'event: message_start\ndata: {"type":"message_start","message":{"content":[]}}\n\n',
        b"data: {not json\n\n",
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}\n\n',
        b'data: {"type":"message_start","message":{"content":[]}}\n\n'
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
        b'data: {"type":"message_stop"}\n\n',
    ],
    ids=["cut short", "unparsable", "delta of no block", "block left open"],
)
async def test_a_broken_stream_is_upstream_error(body: bytes) -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    with pytest.raises(UpstreamError):
        await reply_of(FakeMessagesAPI(), hi(), stream=True, transport=httpx.MockTransport(handle))


# -- errors ------------------------------------------------------------------------------------


async def failure(api: FakeMessagesAPI, expected: type[TurnstoreError], stream: bool) -> Any:
    with pytest.raises(expected) as raised:
        await reply_of(api, hi(), stream=stream)
    assert type(raised.value) is expected
    return raised.value


@STREAM
@pytest.mark.parametrize(("header", "passed"), [("7", "7"), (None, "30"), ("soon; x", None)])
async def test_429_is_rate_limited_with_retry_after(
    stream: bool, header: str | None, passed: str | None
) -> None:
    api = FakeMessagesAPI().then(Script(http_status=429, retry_after=header))
    assert (await failure(api, RateLimited, stream)).retry_after == passed


@STREAM
async def test_529_overloaded_is_rate_limited(stream: bool) -> None:
    api = FakeMessagesAPI().then(Script(http_status=529, retry_after="3"))
    assert (await failure(api, RateLimited, stream)).retry_after == "3"


@STREAM
async def test_a_prompt_too_long_is_context_length_exceeded(stream: bool) -> None:
    await failure(FakeMessagesAPI(context_tokens=5), ContextLengthExceeded, stream)


@STREAM
@pytest.mark.parametrize("status", [500, 401, 403, 404, 413])
async def test_other_statuses_are_upstream_error(stream: bool, status: int) -> None:
    await failure(FakeMessagesAPI().then(Script(http_status=status)), UpstreamError, stream)


async def test_another_400_is_the_request_refused_with_the_client_s_param() -> None:
    message = "max_tokens: Input should be less than or equal to 64000"
    api = FakeMessagesAPI().then(Script(http_status=400, message=message))
    refused = await failure(api, ProviderRefused, stream=False)
    assert refused.param == "max_output_tokens"
    assert refused.client_error().status == 400
    assert message not in str(refused)  # the provider's words never reach the client


@STREAM
async def test_a_timeout_is_upstream_timeout(stream: bool) -> None:
    api = FakeMessagesAPI().then(Script(exception=httpx.ReadTimeout("read timed out")))
    await failure(api, UpstreamTimeout, stream)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("overloaded_error", RateLimited),
        ("rate_limit_error", RateLimited),
        ("api_error", UpstreamError),
        ("invalid_request_error", ContextLengthExceeded),
    ],
)
async def test_an_error_event_mid_stream_is_a_domain_error(
    kind: str, expected: type[TurnstoreError]
) -> None:
    message = (
        "prompt is too long: 210000 tokens > 200000 maximum" if kind.startswith("inv") else None
    )
    script = Script(blocks=[Text("partial"), Text("more")], error_type=kind, message=message)
    received: list[ProviderEvent] = []
    llm = provider(FakeMessagesAPI().then(script))
    with pytest.raises(expected):
        async for event in llm.respond(hi(), stream=True):
            received.append(event)
    await llm.close()
    assert received and not any(isinstance(e, Reply) for e in received)


async def test_the_key_is_in_no_repr_error_or_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    api = FakeMessagesAPI(api_key="sk-ant-other")  # the provider's key is refused: 401
    llm = provider(api)
    assert API_KEY not in repr(llm) and API_KEY not in repr(llm.endpoint)
    with pytest.raises(UpstreamError) as raised:
        await reply_of(api, hi(), stream=False)
    error: BaseException | None = raised.value
    while error is not None:
        assert API_KEY not in str(error) and API_KEY not in repr(error)
        error = error.__cause__
    assert all(API_KEY not in record.getMessage() for record in caplog.records)
    assert caplog.records  # the refusal was logged (without the key)
    await llm.close()


# -- the rest of the port ----------------------------------------------------------------------


def test_origin_is_the_endpoint_without_credentials() -> None:
    llm = provider(FakeMessagesAPI(), base_url="https://user:pw@fake.invalid/")
    assert llm.origin == Origin("anthropic", "https://fake.invalid/v1/messages", "claude-test")
    assert llm.origin_for("claude-other").model == "claude-other"
    assert llm.origin_for(None) is llm.origin
    default = AnthropicEndpoint("anthropic", None, API_KEY, "claude-test")
    assert default.url == "https://api.anthropic.com/v1/messages"


def test_origin_records_the_kind_and_the_keys_fingerprint_never_the_key() -> None:
    llm = provider(FakeMessagesAPI())
    assert llm.origin.kind == "anthropic"
    assert llm.origin.key_fingerprint == key_id(API_KEY)
    assert API_KEY not in repr(llm.origin) and API_KEY not in repr(llm.origin_for("claude-2"))
    assert llm.origin_for("claude-2").key_fingerprint == key_id(API_KEY)
    other = provider(FakeMessagesAPI(), api_key="sk-ant-another")
    assert other.origin.key_fingerprint != llm.origin.key_fingerprint
    assert other.origin == llm.origin  # a rotated key opens what the old one was given


async def test_count_tokens_sends_a_create_s_body_less_max_tokens() -> None:
    api = FakeMessagesAPI()
    llm = provider(api)
    counted = await llm.count_tokens(replace(hi(max_output_tokens=100), instructions="Hi."))
    await llm.close()
    assert api.urls == [f"{BASE}/v1/messages/count_tokens"]
    assert counted > 0 and "max_tokens" not in api.requests[0] and "stream" not in api.requests[0]


async def test_compact_is_refused_with_context_management() -> None:
    with pytest.raises(InvalidInput) as raised:
        await provider(FakeMessagesAPI()).compact(hi())
    assert raised.value.param == "context_management"
