"""The fake Chat Completions server (tests/support/fake_chat.py) speaks the wire format the
official ``openai`` SDK's ``chat.completions`` reads, streamed and not, under strict response
validation, in both its shapes (vLLM's, Ollama's), and refuses what it says it refuses with
vLLM's error body (the SDK raises its own exception classes on them)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.support.fake_chat import API_KEY, BASE_URL, Call, FakeChatServer, Script

MODEL = "qwen-test"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
VLLM_ID = re.compile(r"chatcmpl-[0-9a-f]{32}")
VLLM_CALL = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
OLLAMA_CALL = re.compile(r"call_[a-z0-9]{8}")


def client_of(server: FakeChatServer, *, strict: bool = True) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=server.transport)
    return openai.AsyncOpenAI(
        base_url=BASE_URL, api_key=API_KEY, http_client=http, max_retries=0,
        _strict_response_validation=strict,
    )  # fmt: skip


@pytest.fixture(params=["vllm", "ollama"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakeChatServer, Any]]:
    server = FakeChatServer(mode=request.param)
    async with client_of(server) as client:
        yield server, client


HELLO = [{"role": "user", "content": "Hello"}]


async def test_a_whole_reply_is_a_chat_completion_with_its_thinking(served: Any) -> None:
    server, client = served
    done: ChatCompletion = await client.chat.completions.create(model=MODEL, messages=HELLO)
    message = done.choices[0].message
    assert message.content == "reply 1" and done.choices[0].finish_reason == "stop"
    field = "reasoning" if server.mode == "ollama" else "reasoning_content"
    assert (message.model_extra or {})[field] == "thinking 1"
    assert done.usage is not None and done.usage.total_tokens > 0
    if server.mode == "vllm":
        assert VLLM_ID.fullmatch(done.id)
        assert done.usage.prompt_tokens_details is not None


async def test_a_tool_call_and_its_answer(served: Any) -> None:
    server, client = served
    server.then(Script(calls=[Call("weather", {"city": "Oslo"})]), Script(reasoning=""))
    done = await client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    [call] = done.choices[0].message.tool_calls or []
    assert done.choices[0].finish_reason == "tool_calls"
    assert (OLLAMA_CALL if server.mode == "ollama" else VLLM_CALL).fullmatch(call.id)
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    history = [
        *HELLO,
        json.loads(server.issued[-1].raw),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answered = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert answered.choices[0].message.content == "reply 2"


async def test_a_stream_parses_chunk_by_chunk_and_ends_with_usage_then_done(served: Any) -> None:
    server, client = served
    server.then(Script(content="one two three four", calls=[Call("weather", {"city": "Rome"})]))
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, tools=TOOLS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks: list[ChatCompletionChunk] = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    field = "reasoning" if server.mode == "ollama" else "reasoning_content"
    thinking = "".join(
        (c.choices[0].delta.model_extra or {}).get(field) or "" for c in chunks if c.choices
    )
    assert (text, thinking) == ("one two three four", "thinking 1")
    assert len({chunk.id for chunk in chunks}) == 1


async def test_the_sdk_accumulates_a_stream_into_the_message_sent_whole(served: Any) -> None:
    server, client = served
    server.then(Script(content="alpha beta", calls=[Call("weather", {"city": "Rome"})]))
    async with client.chat.completions.stream(model=MODEL, messages=HELLO, tools=TOOLS) as s:
        final = await s.get_final_completion()
    message = final.choices[0].message
    issued = server.issued[-1].message
    assert message.content == "alpha beta"
    assert [c.id for c in message.tool_calls or []] == [c["id"] for c in issued["tool_calls"]]


async def test_without_include_usage_no_usage_chunk_is_sent(served: Any) -> None:
    _server, client = served
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices for chunk in chunks) and chunks[-1].usage is None


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"bogus": 1}, 400, "Extra inputs are not permitted: bogus"),
        ({"model": "nope"}, 404, "does not exist"),
        ({"messages": [*HELLO, {"role": "tool", "tool_call_id": "x", "content": "s"}]}, 400, "answers no earlier tool call"),
        ({"messages": [{"role": "assistant", "content": "a", "reasoning_content": "forged"}, *HELLO]}, 400, "not issued"),
        ({"messages": [{"role": "user", "content": "x" * 200_000}]}, 400, "maximum context length is"),
        ({"reasoning_effort": "huge"}, 400, "Input should be one of"),
    ],
)  # fmt: skip
async def test_refusals_come_as_vllms_error_body(
    change: dict[str, Any], status: int, says: str
) -> None:
    server = FakeChatServer()
    async with client_of(server) as client:
        body = {"model": MODEL, "messages": HELLO, **change}
        extra = {k: v for k, v in body.items() if k not in ("model", "messages")}
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(
                model=body["model"], messages=body["messages"], extra_body=extra
            )
    assert refused.value.status_code == status
    error = refused.value.body
    assert isinstance(error, dict) and says in error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


async def test_a_replayed_message_goes_back_as_issued_and_not_to_another_model() -> None:
    server = FakeChatServer()
    async with client_of(server) as client:
        await client.chat.completions.create(model=MODEL, messages=HELLO)
        issued = json.loads(server.issued[-1].raw)
        again = [*HELLO, issued, {"role": "user", "content": "more"}]
        await client.chat.completions.create(model=MODEL, messages=again)
        altered = [*HELLO, {**issued, "reasoning_content": "thinking 1!"}, *HELLO]
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=altered)
        with pytest.raises(openai.BadRequestError, match="another model"):
            await client.chat.completions.create(model="qwen-other", messages=again)


async def test_a_wrong_key_is_401_and_a_keyless_server_takes_any() -> None:
    async with openai.AsyncOpenAI(
        base_url=BASE_URL, api_key="wrong", max_retries=0,
        http_client=httpx.AsyncClient(transport=FakeChatServer().transport),
    ) as client:  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=MODEL, messages=HELLO)
    async with client_of(FakeChatServer(api_key=None)) as client:
        await client.chat.completions.create(model=MODEL, messages=HELLO)


async def test_a_server_without_tool_call_ids_sends_none_which_strict_sdks_refuse() -> None:
    server = FakeChatServer(ids=False).then(Script(calls=[Call("weather")]))
    async with client_of(server) as client:
        with pytest.raises(openai.APIResponseValidationError):
            await client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    server.then(Script(calls=[Call("weather")]))
    async with client_of(server, strict=False) as lax:
        done = await lax.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS)
    assert "id" not in done.choices[0].message.tool_calls[0].model_fields_set  # type: ignore[index]


async def test_max_tokens_cuts_the_reply_with_finish_reason_length() -> None:
    server = FakeChatServer().then(Script(content="a long answer " * 20))
    async with client_of(server) as client:
        done = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert done.choices[0].finish_reason == "length"
    assert len(done.choices[0].message.content or "") == 16


async def test_a_429_carries_retry_after() -> None:
    server = FakeChatServer().then(Script(http_status=429, message="Too many requests"))
    async with client_of(server) as client:
        with pytest.raises(openai.RateLimitError) as limited:
            await client.chat.completions.create(model=MODEL, messages=HELLO)
    assert limited.value.response.headers["retry-after"] == "7"
