"""ChatProvider against the strict fake Chat Completions server (tests/support/fake_chat.py),
whole and streamed, in vLLM's shape and Ollama's.

The fake refuses an unknown field, a tool message answering no call, and an assistant message
whose thinking or tool calls differ from what it issued: a conversation it accepts turn after
turn is one whose messages went back as they came."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import httpx
import msgspec
import pytest

from service.core.errors import (
    CompactionUnsupported,
    ContentFiltered,
    ContextLengthExceeded,
    InvalidInput,
    ProviderRefused,
    RateLimited,
    TurnstoreError,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.model import Origin, key_id
from service.core.translate.chat_messages import is_chat, reasoning_id
from service.core.usage import Usage
from service.providers.base import ItemDone, ProviderEvent, ProviderRequest, Reply, TextDelta
from service.providers.chat_completions import ChatEndpoint, ChatProvider, kept
from service.providers.chat_completions_request import chat_body
from service.providers.wire import WireLimits
from service.usecases.restore import Restorer
from service.usecases.secret_ids import IdsSource
from tests.support.fake_chat import API_KEY, BASE_URL, Call, FakeChatServer, Script
from tests.support.memory import MemoryStore

STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
MODES = pytest.mark.parametrize("mode", ["vllm", "ollama"])
MODEL = "qwen-test"
TOOLS = msgspec.Raw(b'[{"type":"function","name":"weather","parameters":{"type":"object"}}]')


def raw(item: dict[str, Any]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(item))


def user(text: str) -> msgspec.Raw:
    return raw(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )


def output_of(call_id: str, output: str) -> msgspec.Raw:
    return raw({"type": "function_call_output", "call_id": call_id, "output": output})


SSE = {"content-type": "text/event-stream"}


class Recording(httpx.AsyncBaseTransport):
    """The fake's answers, their bytes kept."""

    def __init__(self, server: FakeChatServer) -> None:
        self.server, self.bodies = server, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        answer = self.server.handle(request)
        body = answer.read()
        self.bodies.append(body)
        return httpx.Response(answer.status_code, headers=answer.headers, content=body)


def provider(server: FakeChatServer, key: str | None = API_KEY, **options: Any) -> ChatProvider:
    transport = options.pop("transport", Recording(server))
    limits = {"connect_timeout_s": 1.0, "read_timeout_s": 1.0, "max_body_bytes": 1 << 20}
    endpoint = ChatEndpoint("vllm", options.pop("base_url", BASE_URL), key, MODEL)
    return ChatProvider(endpoint, WireLimits(**(limits | options)), transport=transport)


async def events_of(
    server: FakeChatServer, request: ProviderRequest, *, stream: bool, **options: Any
) -> list[ProviderEvent]:
    llm = provider(server, **options)
    try:
        return [event async for event in llm.respond(request, stream=stream)]
    finally:
        await llm.close()


async def reply_of(server: FakeChatServer, request: ProviderRequest, *, stream: bool) -> Reply:
    last = (await events_of(server, request, stream=stream))[-1]
    assert isinstance(last, Reply)
    return last


async def test_a_whole_reply_is_kept_as_the_bytes_the_server_sent() -> None:
    server = FakeChatServer()
    transport = Recording(server)
    llm = provider(server, transport=transport)
    [reply] = [e async for e in llm.respond(ProviderRequest([user("Hi")]), stream=False)]
    assert isinstance(reply, Reply)
    [item] = reply.output_items
    assert bytes(item) in transport.bodies[0]  # the very bytes, not a re-encoding
    assert bytes(item).startswith(b'{"role":"assistant","content":"reply 1","refusal":null')
    assert is_chat(item) and reply.text == "reply 1" and reply.status == "completed"
    assert reply.usage is not None and reply.usage.cached_tokens == reply.usage.input_tokens // 2
    await llm.close()


@MODES
async def test_a_stream_is_kept_as_the_message_sent_whole_and_its_thinking_comes_first(
    mode: str,
) -> None:
    server = FakeChatServer(mode=mode).then(
        Script(
            content="Sunny and warm",
            reasoning="Let me think",
            calls=[Call("weather", {"city": "Oslo"})],
        )
    )
    request = ProviderRequest([user("Weather?")], tools=TOOLS)
    events = await events_of(server, request, stream=True)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "ItemDone" and kinds[-1] == "Reply" and "TextDelta" in kinds
    first = events[0]
    assert isinstance(first, ItemDone) and first.partial
    assert json.loads(bytes(first.item))["id"] == reasoning_id("Let me think")
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    reply = events[-1]
    assert isinstance(reply, Reply) and text == reply.text == "Sunny and warm"
    [item] = reply.output_items
    expected = dict(server.issued[-1].message)
    expected["tool_calls"] = [
        {k: v for k, v in c.items() if k != "index"} for c in expected["tool_calls"]
    ]
    assert json.loads(bytes(item)) == expected and bytes(item).startswith(b'{"role":"assistant"')
    field = "reasoning" if mode == "ollama" else "reasoning_content"
    assert list(json.loads(bytes(item)))[-1] == field  # under the name the server streamed it by
    assert reply.usage is not None and reply.usage.output_tokens > 0


@STREAM
@MODES
async def test_a_conversation_goes_back_byte_for_byte_over_several_turns(
    stream: bool, mode: str
) -> None:
    """Each turn sends every earlier message as kept (the fake refuses one whose thinking or
    calls changed); tool turns answer with a tool message of the call's id."""
    server = FakeChatServer(mode=mode)
    history: list[msgspec.Raw] = []
    for n in range(1, 7):
        if n % 3 == 0:
            server.then(Script(calls=[Call("weather", {"n": n}), Call("weather", {"m": n})]))
        else:
            server.then(Script(reasoning=f"ünï thinking {n}\nlines"))
        pending = history[-1:] if history and b"tool_calls" in bytes(history[-1]) else []
        new = [output_of(cid, "sunny") for cid in _call_ids(pending)] or [user(f"Turn {n}")]
        reply = await reply_of(
            server, ProviderRequest([*history, *new], tools=TOOLS), stream=stream
        )
        history += [*new, *reply.output_items]
    assert not server.refusals
    sent = server.raw_bodies[-1]
    replies = [item for item in history[:-1] if is_chat(item)]  # all but the last reply's
    assert len(replies) == 5 and all(bytes(item) in sent for item in replies)  # verbatim
    last = server.requests[-1]["messages"]
    tools = [m for m in last if m["role"] == "tool"]
    assert len(tools) == 2 and all(m["content"] == "sunny" for m in tools)


def _call_ids(items: list[msgspec.Raw]) -> list[str]:
    return [c["id"] for item in items for c in json.loads(bytes(item)).get("tool_calls") or ()]


@STREAM
async def test_a_server_without_tool_call_ids_gets_ids_minted_once_that_never_collide(
    stream: bool,
) -> None:
    server = FakeChatServer(ids=False)
    server.then(Script(calls=[Call("weather"), Call("weather")]), Script())
    reply = await reply_of(server, ProviderRequest([user("Hi")], tools=TOOLS), stream=stream)
    [item] = reply.output_items
    ids = _call_ids([item])
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    again = [user("Hi"), item, *(output_of(i, "ok") for i in ids)]
    await reply_of(server, ProviderRequest(again, tools=TOOLS), stream=stream)
    assert not server.refusals and bytes(item) in server.raw_bodies[-1]
    assert kept(b'{"role":"assistant","tool_calls":[{"type":"function"}]}') != kept(
        b'{"role":"assistant","tool_calls":[{"type":"function"}]}'
    )  # minted afresh each time a reply comes: never the same id for two calls


def test_a_message_not_written_role_first_is_kept_role_first() -> None:
    raw_message = b'{"content":"hi","reasoning_content":"r","role":"assistant"}'
    item = kept(raw_message)
    assert bytes(item) == b'{"role":"assistant","content":"hi","reasoning_content":"r"}'
    assert kept(b'{"role":"assistant","content":"x"}') == msgspec.Raw(
        b'{"role":"assistant","content":"x"}'
    )


@STREAM
@pytest.mark.parametrize(
    ("script", "status", "reason"),
    [
        (Script(finish_reason="length"), "incomplete", "max_output_tokens"),
        (Script(finish_reason="stop"), "completed", None),
    ],
)
async def test_finish_reasons(
    stream: bool, script: Script, status: str, reason: str | None
) -> None:
    reply = await reply_of(
        FakeChatServer().then(script), ProviderRequest([user("x")]), stream=stream
    )
    assert (reply.status, reply.incomplete_reason) == (status, reason)


@STREAM
@pytest.mark.parametrize(
    ("script", "error"),
    [
        (Script(finish_reason="content_filter"), ContentFiltered),
        (Script(finish_reason="weird"), UpstreamError),
        (Script(http_status=429), RateLimited),
        (Script(http_status=500), UpstreamError),
        (Script(http_status=400, message="This model's maximum context length is 8 tokens."), ContextLengthExceeded),
        (Script(http_status=400, message="something else"), ProviderRefused),
        (Script(raw_body=b"{not json"), UpstreamError),
        (Script(exception=httpx.ReadTimeout("slow")), UpstreamTimeout),
        (Script(exception=httpx.ConnectError("down")), UpstreamError),
    ],
)  # fmt: skip
async def test_failures_map_to_domain_errors(
    stream: bool, script: Script, error: type[TurnstoreError]
) -> None:
    with pytest.raises(error) as raised:
        await events_of(FakeChatServer().then(script), ProviderRequest([user("x")]), stream=stream)
    if error is RateLimited:
        assert raised.value.retry_after == "7"  # type: ignore[attr-defined]


async def test_a_stream_error_or_a_stream_cut_short_is_upstream_error() -> None:
    with pytest.raises(UpstreamError):
        await events_of(
            FakeChatServer().then(Script(stream_error=True)),
            ProviderRequest([user("x")]),
            stream=True,
        )

    def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')

    with pytest.raises(UpstreamError, match="ended before"):
        await events_of(
            FakeChatServer(),
            ProviderRequest([user("x")]),
            stream=True,
            transport=httpx.MockTransport(cut),
        )


async def test_a_refused_field_names_the_clients_param() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        error = {
            "message": "bad",
            "type": "BadRequestError",
            "param": "response_format",
            "code": 400,
        }
        return httpx.Response(400, json={"error": error})

    with pytest.raises(ProviderRefused) as refused:
        await events_of(
            FakeChatServer(),
            ProviderRequest([user("x")]),
            stream=False,
            transport=httpx.MockTransport(refuse),
        )
    assert refused.value.param == "text"
    old = {"object": "error", "message": "This model's maximum context length is 4096 tokens.", "type": "BadRequestError", "param": None, "code": 400}  # fmt: skip
    with pytest.raises(ContextLengthExceeded):
        transport = httpx.MockTransport(lambda r: httpx.Response(400, json=old))
        await events_of(
            FakeChatServer(), ProviderRequest([user("x")]), stream=False, transport=transport
        )


async def test_a_key_is_sent_as_bearer_and_without_one_no_authorization_goes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeChatServer()
    await reply_of(server, ProviderRequest([user("x")]), stream=False)
    assert server.headers[-1]["authorization"] == f"Bearer {API_KEY}"
    keyless = FakeChatServer(api_key=None)
    llm = provider(keyless, key=None)
    caplog.set_level(logging.DEBUG)
    [_ async for _ in llm.respond(ProviderRequest([user("x")]), stream=False)]
    assert "authorization" not in keyless.headers[-1]
    assert API_KEY not in repr(llm) and API_KEY not in repr(llm.endpoint)
    assert (llm.origin.kind, llm.origin.key_fingerprint) == ("chat", None)
    keyed = provider(FakeChatServer()).origin
    assert (keyed.kind, keyed.key_fingerprint) == ("chat", key_id(API_KEY))
    failing = provider(FakeChatServer().then(Script(http_status=500)))
    with pytest.raises(UpstreamError) as failed:
        [_ async for _ in failing.respond(ProviderRequest([user("x")]), stream=False)]
    assert API_KEY not in str(failed.value) and API_KEY not in caplog.text


async def test_no_token_counting_and_no_compaction() -> None:
    llm = provider(FakeChatServer())
    with pytest.raises(InvalidInput, match="cannot count tokens"):
        await llm.count_tokens(ProviderRequest([user("x")]))
    with pytest.raises(CompactionUnsupported):
        await llm.compact(ProviderRequest([user("x")]))
    assert not llm.compacts(None)


# -- the request -------------------------------------------------------------------------------


def body_of(request: ProviderRequest, *, stream: bool = False) -> dict[str, Any]:
    return json.loads(chat_body(request, MODEL, stream=stream))  # type: ignore[no-any-return]


def fields(**values: Any) -> dict[str, msgspec.Raw]:
    return {name: raw(value) for name, value in values.items()}


def test_the_clients_fields_are_mapped_to_chats() -> None:
    request = ProviderRequest(
        [user("x")],
        tools=TOOLS,
        fields=fields(
            temperature=0.2, top_p=0.9, max_output_tokens=50, tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False, reasoning={"effort": "low", "summary": "auto"},
            text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            safety_identifier="u1", metadata={"a": "b"}, store=False,
        ),
    )  # fmt: skip
    body = body_of(request, stream=True)
    assert list(body)[:4] == ["model", "messages", "stream", "stream_options"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    assert body["temperature"] == 0.2 and body["top_p"] == 0.9 and body["max_tokens"] == 50
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False and body["reasoning_effort"] == "low"
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert body["user"] == "u1" and "metadata" not in body and "store" not in body
    assert not body_of(ProviderRequest([user("x")]))["stream"]


@pytest.mark.parametrize(
    ("name", "value", "param"),
    [
        ("top_logprobs", 3, "top_logprobs"),
        ("max_tool_calls", 2, "max_tool_calls"),
        ("reasoning", {"effort": "extreme"}, "reasoning.effort"),
        ("text", {"format": {"type": "json_schema", "schema": {}}}, "text.format"),
        ("text", {"verbosity": "low"}, "text"),
        ("service_tier", "priority", "service_tier"),
        ("temperature", "hot", "temperature"),
        ("context_management", [{"type": "compaction"}], "context_management"),
    ],
)
def test_a_field_chat_cannot_honour_is_refused_with_its_param(
    name: str, value: Any, param: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        body_of(ProviderRequest([user("x")], fields=fields(**{name: value})))
    assert refused.value.param == param


def test_a_responses_history_becomes_chat_messages_with_tool_pairs_of_the_same_id() -> None:
    items = [
        raw({"type": "message", "role": "developer", "content": "Be brief."}),
        user("Weather in Oslo?"),
        raw({"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}),
        raw({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}),
        raw({"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'}),
        output_of("call_1", "sunny"),
        raw({"role": "user", "content": [
            {"type": "input_text", "text": "And this?"},
            {"type": "input_image", "image_url": "https://img.example/a.png"},
        ]}),
        raw({"type": "compaction", "encrypted_content": "x"}),
    ]  # fmt: skip
    body = body_of(ProviderRequest(items, instructions="You help."))
    assert body["messages"] == [
        {"role": "system", "content": "You help.\n\nBe brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [
            {"type": "text", "text": "And this?"},
            {"type": "image_url", "image_url": {"url": "https://img.example/a.png"}},
        ]},
    ]  # fmt: skip
    file_part = {"type": "input_file", "file_id": "file-1"}
    with pytest.raises(InvalidInput):
        body_of(ProviderRequest([raw({"role": "user", "content": [file_part]})]))


def test_anthropics_blocks_go_as_text_and_tool_calls_without_their_thinking() -> None:
    items = [
        user("Hi"),
        raw({"type": "thinking", "thinking": "hmm", "signature": "c2ln"}),
        raw({"type": "text", "text": "Let me look."}),
        raw({"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {"city": "Oslo"}}),
        output_of("toolu_01", "sunny"),
    ]
    messages = body_of(ProviderRequest(items))["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"id": "toolu_01", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}],
    }  # fmt: skip
    assert "hmm" not in json.dumps(messages)


async def test_a_message_brought_back_in_a_reasoning_item_goes_verbatim_and_once() -> None:
    """A client that keeps its own history sends back what it was shown of a Chat message:
    its thinking carrying the message sealed, then its text and its call. The message goes to
    its server verbatim, and its text and call not a second time."""
    message = b'{"role":"assistant","content":"Done.","tool_calls":[{"id":"c9","type":"function","function":{"name":"w","arguments":"{}"}}],"reasoning_content":"why"}'
    ids = IdsSource(os.urandom(32))
    origin = Origin("vllm", BASE_URL, MODEL)
    sealed = (await ids.get()).seal(origin, message.decode())
    items = [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": sealed},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "function_call", "call_id": "c9", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c9", "output": "ok"},
    ]  # fmt: skip
    restored = await Restorer(MemoryStore().reads, ids).restore("owner", items, origin=origin)
    sent = chat_body(ProviderRequest(restored), MODEL, stream=False)
    assert message in sent
    messages = json.loads(sent)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]


def test_usage_is_counted_as_openai_counts_it() -> None:
    from service.providers.chat_completions import _Usage

    usage = msgspec.json.decode(
        b'{"prompt_tokens":100,"completion_tokens":40,"prompt_tokens_details":{"cached_tokens":60},'
        b'"completion_tokens_details":{"reasoning_tokens":25}}',
        type=_Usage,
    )
    assert usage.value() == Usage(100, 60, 40, 25, 140)


def _streamed(*deltas: dict[str, Any]) -> httpx.MockTransport:
    """A server that streams these deltas, then its finish and [DONE]."""
    chunks = [{"choices": [{"index": 0, "delta": delta}]} for delta in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    lines = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    answer = httpx.Response(200, headers=SSE, content="".join(lines).encode())
    return httpx.MockTransport(lambda _: answer)


async def _kept_of(*deltas: dict[str, Any]) -> dict[str, Any]:
    """The message kept of a streamed reply of these deltas."""
    events = await events_of(
        FakeChatServer(), ProviderRequest([user("x")]), stream=True, transport=_streamed(*deltas)
    )
    reply = events[-1]
    assert isinstance(reply, Reply)
    kept: dict[str, Any] = json.loads(bytes(reply.output_items[0]))
    return kept


async def test_calls_streamed_whole_at_one_index_stay_apart() -> None:
    """Ollama streams each of several calls whole, all at index 0: a delta naming another id
    begins another call (they were once one call named "writewrite" with both arguments)."""
    calls = [
        {
            "index": 0,
            "id": f"call_{n}",
            "type": "function",
            "function": {"name": "write", "arguments": json.dumps({"path": f"{n}.py"})},
        }
        for n in "ab"
    ]
    kept = await _kept_of({"role": "assistant"}, *({"tool_calls": [c]} for c in calls))
    named = [(call["id"], call["function"]["name"]) for call in kept["tool_calls"]]
    assert named == [("call_a", "write"), ("call_b", "write")]
    arguments = [json.loads(call["function"]["arguments"]) for call in kept["tool_calls"]]
    assert arguments == [{"path": "a.py"}, {"path": "b.py"}]


async def test_thinking_streamed_under_both_names_is_kept_once_under_each() -> None:
    """A server that sends its thinking as reasoning_content and reasoning alike (aliases) is
    kept as its whole reply would be: each name once, not the two joined."""
    thinking = [{"reasoning_content": t, "reasoning": t} for t in ("Think ", "hard")]
    kept = await _kept_of(*thinking, {"content": "Hi"})
    assert kept["reasoning_content"] == kept["reasoning"] == "Think hard"
    assert kept["content"] == "Hi"
