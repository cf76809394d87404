"""The fake Anthropic Messages API (tests/support/fake_anthropic.py) speaks the real wire format,
as the official ``anthropic`` SDK models it, and refuses what the real API refuses.

Every JSON body validates as ``anthropic.types.Message`` with no field the SDK does not know and
nothing coerced; every streamed event as the SDK's ``RawMessageStreamEvent`` (``ping`` and
``error`` are handled by the SDK's stream itself); the SDK's stream helpers accumulate a stream
into the same message, block for block, signatures included, as the reply sent whole. Errors
raise the SDK's own exception classes. The SDK speaks ``httpx2``, the fake ``httpx`` (as
turnstore does): ``Bridge`` carries requests and responses across, bytes unchanged.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import typing
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import BaseModel, TypeAdapter

from tests.support.fake_anthropic import (
    API_KEY,
    FakeMessagesAPI,
    Redacted,
    Script,
    Text,
    Thinking,
    ToolUse,
    estimate_tokens,
    redacted_data,
    signature_of,
)

URL = "https://fake.invalid/v1/messages"
HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
THINKING = {"type": "enabled", "budget_tokens": 1024}
EVENT = TypeAdapter(RawMessageStreamEvent)
EVENT_TYPES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]
    for cls in typing.get_args(typing.get_args(RawMessageStreamEvent)[0])
}
MESSAGE_ID = re.compile(r"msg_01[0-9A-Za-z]{22}")
TOOL_ID = re.compile(r"toolu_01[0-9A-Za-z]{22}")
REQUEST_ID = re.compile(r"req_011C[0-9A-Za-z]{20}")

SCRIPTS = {
    "text": Script(blocks=[Text("Hello, wire format!")]),
    "default": Script(),
    "thinking": Script(
        blocks=[Thinking("first"), Thinking(""), Redacted(), Thinking("last"), Text("ok")]
    ),
    "tool_use": Script(blocks=[Thinking("plan"), ToolUse("lookup", {"q": "x", "n": [1, 2]})]),
    "two tools": Script(blocks=[ToolUse("a", {}), ToolUse("b", {"k": "v"})]),
    "max_tokens": Script(blocks=[Text("cut")], stop_reason="max_tokens"),
    "stop_sequence": Script(
        blocks=[Text("up to")], stop_reason="stop_sequence", stop_sequence="##"
    ),
    "refusal": Script(blocks=[Text("I can't")], stop_reason="refusal"),
}


class Bridge(httpx2.AsyncBaseTransport):
    """An ``httpx2`` transport that hands each request to the fake as an ``httpx`` request."""

    def __init__(self, api: FakeMessagesAPI) -> None:
        self.api = api

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        answer = await self.api.handle(
            httpx.Request(
                request.method, str(request.url), headers=request.headers.raw, content=body
            )
        )
        return httpx2.Response(
            answer.status_code, headers=answer.headers.raw, stream=_Chunks(answer)
        )


class _Chunks(httpx2.AsyncByteStream):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        stream = self.response.stream  # the fake's own bytes, however it made them
        assert isinstance(stream, httpx.AsyncByteStream)
        async for chunk in stream:
            yield chunk


@pytest.fixture
async def claude() -> AsyncIterator[tuple[FakeMessagesAPI, anthropic.AsyncAnthropic]]:
    api = FakeMessagesAPI(min_cache_tokens=256)
    async with httpx2.AsyncClient(transport=Bridge(api)) as http:
        client = anthropic.AsyncAnthropic(
            api_key=API_KEY, base_url="https://fake.invalid", http_client=http, max_retries=0
        )
        yield api, client


def request(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "claude-test",
        "max_tokens": 2048,
        "thinking": THINKING,
        "messages": [{"role": "user", "content": "hi"}],
    }
    return {k: v for k, v in {**body, **overrides}.items() if v is not None}


async def post(api: FakeMessagesAPI, body: object, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as http:
        return await http.post(URL, json=body, headers={**HEADERS, **headers})


def unknown_fields(value: object, path: str = "$") -> list[str]:
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in unknown_fields(v, f"{path}[{i}]")]
    if not isinstance(value, BaseModel):
        return []
    found = [f"{path}.{name}" for name in value.model_extra or {}]
    for name in type(value).model_fields:
        found += unknown_fields(getattr(value, name), f"{path}.{name}")
    return found


def assert_exact(model: BaseModel, payload: dict[str, Any]) -> None:
    assert unknown_fields(model) == []
    assert model.model_dump(mode="json", exclude_unset=True) == payload  # nothing coerced


def without_ids(message: Message) -> dict[str, Any]:
    """The message as a client reads it, but for the ids minted per call (and the stream
    helper's own ``parsed_output``)."""
    dumped = message.model_dump(mode="json", exclude_none=True)
    dumped.pop("id")
    for block in dumped["content"]:
        block.pop("id", None)
        block.pop("parsed_output", None)
    return dumped


# -- the wire format -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCRIPTS)
async def test_json_bodies_are_sdk_messages(name: str) -> None:
    api = FakeMessagesAPI().then(SCRIPTS[name])
    answer = await post(api, request())
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert REQUEST_ID.fullmatch(answer.headers["request-id"])
    body = answer.json()
    message = Message.model_validate(body)
    assert_exact(message, body)
    assert MESSAGE_ID.fullmatch(message.id)
    scripted = SCRIPTS[name].blocks or [Thinking("thinking 1"), Text("reply 1")]
    kinds = {Text: "text", Thinking: "thinking", Redacted: "redacted_thinking", ToolUse: "tool_use"}
    assert [block.type for block in message.content] == [kinds[type(b)] for b in scripted]
    for block in message.content:
        if block.type == "thinking":
            assert block.signature == signature_of("claude-test", block.thinking)
        elif block.type == "tool_use":
            assert TOOL_ID.fullmatch(block.id)
    tools = any(block.type == "tool_use" for block in message.content)
    assert message.stop_reason == (
        SCRIPTS[name].stop_reason or ("tool_use" if tools else "end_turn")
    )
    assert message.stop_sequence == SCRIPTS[name].stop_sequence
    usage = message.usage
    assert usage.cache_creation_input_tokens == usage.cache_read_input_tokens == 0
    settings = estimate_tokens({"settings": {"thinking": THINKING, "tool_choice": None}})
    prompt = estimate_tokens({"type": "text", "text": "hi", "role": "user"})
    assert usage.input_tokens == settings + prompt and usage.output_tokens > 0


async def test_thinking_blocks_come_only_when_thinking_is_on() -> None:
    api = FakeMessagesAPI().then(SCRIPTS["thinking"])
    message = Message.model_validate((await post(api, request(thinking=None))).json())
    assert [block.type for block in message.content] == ["text"]


@pytest.mark.parametrize("name", SCRIPTS)
async def test_streams_are_sdk_events_in_the_real_order(name: str) -> None:
    api = FakeMessagesAPI().then(SCRIPTS[name])
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as http,
        http.stream("POST", URL, json=request(stream=True), headers=HEADERS) as answer,
    ):
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = (await answer.aread()).decode()
    payloads = []
    for frame in text.strip().split("\n\n"):
        event_line, data_line = frame.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        if payload["type"] != "ping":
            assert payload["type"] in EVENT_TYPES
            assert_exact(EVENT.validate_python(payload), payload)
        payloads.append(payload)
    kinds = [p["type"] for p in payloads]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"] and kinds.count("ping") == 1
    start = payloads[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    final = Message.model_validate(
        (await post(FakeMessagesAPI().then(SCRIPTS[name]), request())).json()
    )
    blocks = [p for p in payloads if p["type"].startswith("content_block")]
    for index, block in enumerate(final.content):
        mine = [p for p in blocks if p["index"] == index]
        assert mine[0]["type"] == "content_block_start" and mine[-1]["type"] == "content_block_stop"
        deltas = [p["delta"] for p in mine[1:-1]]
        if block.type == "thinking":  # the signature last, just before the stop
            assert mine[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
            assert [d["type"] for d in deltas][-1] == "signature_delta"
            assert "".join(d.get("thinking", "") for d in deltas) == block.thinking
        elif block.type == "tool_use":
            assert mine[0]["content_block"]["input"] == {}
            assert {d["type"] for d in deltas} == {"input_json_delta"}
            assert json.loads("".join(d["partial_json"] for d in deltas)) == block.input
        elif block.type == "redacted_thinking":
            assert deltas == [] and mine[0]["content_block"] == block.model_dump()
    assert [p["index"] for p in blocks] == sorted(p["index"] for p in blocks)  # one at a time
    assert payloads[-2]["delta"]["stop_reason"] == final.stop_reason


@pytest.mark.parametrize("name", [name for name in SCRIPTS if name != "default"])
async def test_the_sdk_accumulates_a_stream_into_the_whole_reply(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic], name: str
) -> None:
    api, client = claude
    api.then(SCRIPTS[name], SCRIPTS[name], SCRIPTS[name])
    params: Any = request()
    whole = await client.messages.create(**params)
    async with client.messages.stream(**params) as stream:
        helper = await stream.get_final_message()
    events = [event async for event in await client.messages.create(**params, stream=True)]
    assert [e.type for e in events][:1] == ["message_start"]
    assert without_ids(helper) == without_ids(whole)  # signatures and redacted data included
    assert MESSAGE_ID.fullmatch(helper.id) and helper.id != whole.id
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]
    texts = [
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ]
    assert "".join(texts) == "".join(b.text for b in whole.content if b.type == "text")


ERRORS = {
    "429": (Script(http_status=429), anthropic.RateLimitError, "rate_limit_error"),
    "529": (Script(http_status=529), anthropic.OverloadedError, "overloaded_error"),
    "500": (Script(http_status=500), anthropic.InternalServerError, "api_error"),
    "400": (
        Script(http_status=400, message="bad"),
        anthropic.BadRequestError,
        "invalid_request_error",
    ),
    "403": (Script(http_status=403), anthropic.PermissionDeniedError, "permission_error"),
    "413": (Script(http_status=413), anthropic.ContentTooLargeError, "request_too_large"),
}


@pytest.mark.parametrize("name", ERRORS)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_errors_raise_the_sdk_exceptions(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic], name: str, stream: bool
) -> None:
    api, client = claude
    script, exception, kind = ERRORS[name]
    api.then(script)
    with pytest.raises(exception) as raised:
        await client.messages.create(**request(), stream=stream)
    error = raised.value
    assert error.status_code == script.http_status and error.type == kind
    assert error.request_id is not None and REQUEST_ID.fullmatch(error.request_id)
    assert isinstance(error.body, dict) and error.body["request_id"] == error.request_id
    if kind != "request_too_large":  # the SDK's ErrorResponse does not model that type
        assert_exact(ErrorResponse.model_validate(error.body), error.body)
    assert error.response.headers.get("retry-after") == ("30" if name == "429" else None)
    retry = "true" if name in ("429", "529", "500") else "false"
    assert error.response.headers["x-should-retry"] == retry
    assert len(api.requests) == 1 and bool(api.requests[0].get("stream")) == stream


async def test_retry_after_is_the_scripted_one(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.then(Script(http_status=429, retry_after="7"))
    with pytest.raises(anthropic.RateLimitError) as raised:
        await client.messages.create(**request())
    assert raised.value.response.headers["retry-after"] == "7"


async def test_an_error_event_ends_a_stream(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.then(Script(error_type="overloaded_error"))
    seen = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        async for event in await client.messages.create(**request(), stream=True):
            seen.append(event.type)
    assert raised.value.type == "overloaded_error"
    assert seen[0] == "message_start" and "message_delta" not in seen


async def test_a_wrong_or_missing_key_is_an_authentication_error() -> None:
    api = FakeMessagesAPI()
    async with httpx2.AsyncClient(transport=Bridge(api)) as http:
        client = anthropic.AsyncAnthropic(
            api_key="sk-ant-wrong", base_url="https://fake.invalid", http_client=http, max_retries=0
        )
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await client.messages.create(**request())
    assert raised.value.type == "authentication_error"
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as http:
        headers = {"anthropic-version": "2023-06-01"}
        missing = await http.post(URL, json=request(), headers=headers)
    assert missing.status_code == 401
    assert missing.json()["error"] == {
        "type": "authentication_error",
        "message": "x-api-key header is required",
    }
    no_version = await post(api, request(), **{"anthropic-version": "2022-01-01"})
    assert no_version.status_code == 400 and "anthropic-version" in no_version.text


async def test_count_tokens_counts_the_prompt(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    params = request(system="be brief", max_tokens=None)
    counted = await client.messages.count_tokens(**params)
    message = await client.messages.create(**params, max_tokens=2048)
    assert counted.input_tokens == message.usage.input_tokens > 1  # nothing cached here
    assert len(api.requests) == 2 and api.urls[0].endswith("/v1/messages/count_tokens")


# -- what the fake refuses -------------------------------------------------------------------


async def refused(api: FakeMessagesAPI, body: dict[str, Any]) -> str:
    answer = await post(api, body)
    assert answer.status_code == 400, answer.text
    payload = answer.json()
    assert_exact(ErrorResponse.model_validate(payload), payload)
    assert payload["error"]["type"] == "invalid_request_error"
    return str(payload["error"]["message"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"model": None}, "model: Field required"),
        ({"messages": []}, "messages: at least one message is required"),
        ({"temprature": 1}, "temprature: Extra inputs are not permitted"),
        ({"system": [{"type": "image", "source": {}}]}, "system.0.type: Input should be 'text'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "greater than or equal to 1024"),
        ({"max_tokens": 1024}, "`max_tokens` must be greater than `thinking.budget_tokens`"),
        ({"temperature": 0.5}, "`temperature` may only be set to 1 when thinking is enabled"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages: text content blocks must be non-empty",
        ),
        (
            {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
            "messages.0: all messages must have non-empty content",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be"),
    ],
)
async def test_malformed_bodies_are_refused(change: dict[str, Any], message: str) -> None:
    api = FakeMessagesAPI().then(Script())
    assert message in await refused(api, request(**change))
    assert len(api._scripts) == 1  # a refused request does not use up the script


async def test_an_unknown_model_is_not_found(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    _, client = claude
    with pytest.raises(anthropic.NotFoundError) as raised:
        await client.messages.create(**request(model="claude-nope"))
    assert raised.value.api_message == "model: claude-nope"


async def test_same_role_messages_merge_and_an_assistant_may_speak_first() -> None:
    api = FakeMessagesAPI().then(Script(), Script())
    merged = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
    ]
    assert (await post(api, request(messages=merged))).status_code == 200
    first = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    assert (await post(api, request(messages=first))).status_code == 200


async def test_an_assistant_reply_split_over_two_messages_is_one_turn() -> None:
    api = FakeMessagesAPI()
    messages = (await conversation(api))[:5]
    reply = messages[3]["content"]
    split = [*messages[:3], {"role": "assistant", "content": reply[:2]}]
    split += [{"role": "assistant", "content": reply[2:]}, messages[4]]
    answer = await post(api.then(Script()), request(messages=split))
    assert answer.status_code == 200, answer.text
    split = copy.deepcopy(split)
    split[4]["content"][0]["id"] = "toolu_01other"  # paths name the request's own indexes
    message = await refused(api, request(messages=split))
    assert message.startswith("messages.5.content.0: unexpected `tool_use_id`")


async def test_system_may_be_a_string_or_text_blocks() -> None:
    api = FakeMessagesAPI().then(Script(), Script())
    for system in ("be brief", [{"type": "text", "text": "be brief"}]):
        assert (await post(api, request(system=system))).status_code == 200


# A conversation of three turns with thinking and tools, each reply replayed as it came.
TURNS = [
    Script(
        blocks=[
            Thinking("plan"),
            Thinking("check"),
            Thinking(""),
            Redacted(),
            ToolUse("lookup", {"q": "x"}),
        ]
    ),
    Script(blocks=[Thinking("next"), Redacted("second"), ToolUse("lookup", {"q": "y"})]),
    Script(blocks=[Thinking("done"), Text("the answer")]),
]


def result(call_id: str, text: str = "42") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": text}


async def conversation(api: FakeMessagesAPI) -> list[dict[str, Any]]:
    """The three turns through the fake: the messages of a fourth request, replayed as sent."""
    api.then(*copy.deepcopy(TURNS))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is x?"}]
    for _ in TURNS:
        answer = await post(api, request(messages=messages))
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        messages.append({"role": "assistant", "content": reply["content"]})
        calls = [b["id"] for b in reply["content"] if b["type"] == "tool_use"]
        messages.append({"role": "user", "content": [result(c) for c in calls] or "thanks"})
    return messages


async def test_a_three_turn_conversation_replays_byte_for_byte() -> None:
    api = FakeMessagesAPI()
    messages = await conversation(api)
    api.then(Script(blocks=[Text("you're welcome")]))
    replay = json.dumps(request(messages=messages)).encode()
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as http:
        answer = await http.post(
            URL, content=replay, headers={**HEADERS, "content-type": "application/json"}
        )
    assert answer.status_code == 200, answer.text
    assert api.bodies[-1] == replay
    # Thinking from turns before the latest may be left out, as the real API allows.
    earlier = copy.deepcopy(messages)
    earlier[1]["content"] = [b for b in earlier[1]["content"] if b["type"] == "tool_use"]
    assert (await post(api.then(Script()), request(messages=earlier))).status_code == 200


async def test_the_sdk_replays_its_own_messages(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.then(TURNS[0], TURNS[2])
    first = await client.messages.create(**request())
    calls = [b.id for b in first.content if b.type == "tool_use"]
    messages: Any = [
        *request()["messages"],
        first.to_param(),
        {"role": "user", "content": [result(c) for c in calls]},
    ]
    second = await client.messages.create(**request(messages=messages))
    assert second.content[-1].type == "text"


def altered(
    messages: list[dict[str, Any]], message: int, block: int, key: str
) -> list[dict[str, Any]]:
    """A copy with one character in the middle of a block's field changed."""
    changed = copy.deepcopy(messages)
    value: str = changed[message]["content"][block][key]
    middle = len(value) // 2
    swapped = "A" if value[middle] != "A" else "B"
    changed[message]["content"][block][key] = value[:middle] + swapped + value[middle + 1 :]
    return changed


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ((1, 0, "thinking"), "messages.1.content.0: Invalid `signature` in `thinking` block"),
        ((1, 1, "signature"), "messages.1.content.1: Invalid `signature` in `thinking` block"),
        ((3, 0, "thinking"), "messages.3.content.0: Invalid `signature` in `thinking` block"),
        ((1, 3, "data"), "messages.1.content.3: Invalid `data` in `redacted_thinking` block"),
    ],
)
async def test_a_byte_changed_in_opaque_content_is_refused(
    where: tuple[int, int, str], expected: str
) -> None:
    api = FakeMessagesAPI()
    messages = await conversation(api)
    assert await refused(api, request(messages=altered(messages, *where))) == expected


async def test_a_thinking_block_replayed_to_another_model_is_refused() -> None:
    api = FakeMessagesAPI()
    messages = await conversation(api)
    message = await refused(api, request(model="claude-other", messages=messages))
    assert message == "messages.1.content.0: Invalid `signature` in `thinking` block"
    # Translated for the other model (no thinking of the first), the same history is fine.
    plain = copy.deepcopy(messages)
    for item in plain[1::2]:
        item["content"] = [b for b in item["content"] if b["type"] in ("text", "tool_use")]
    answer = await post(
        api.then(Script()), request(model="claude-other", thinking=None, messages=plain)
    )
    assert answer.status_code == 200, answer.text


async def test_merging_two_thinking_blocks_is_refused() -> None:
    api = FakeMessagesAPI()
    messages = (await conversation(api))[:3]
    plan, check = messages[1]["content"][:2]
    messages[1]["content"][:2] = [{**check, "thinking": plan["thinking"] + check["thinking"]}]
    assert "Invalid `signature` in `thinking` block" in await refused(
        api, request(messages=messages)
    )


@pytest.mark.parametrize("drop", ["redacted_thinking", "thinking"])
async def test_the_latest_assistant_message_keeps_all_its_thinking_blocks(drop: str) -> None:
    api = FakeMessagesAPI()
    messages = (await conversation(api))[:5]  # the latest assistant message is turn 2's
    messages[3]["content"] = [b for b in messages[3]["content"] if b["type"] != drop]
    assert await refused(api, request(messages=messages)) == (
        "messages.3.content.0: `thinking` or `redacted_thinking` blocks in the latest assistant "
        "message cannot be modified. These blocks must remain as they were in the original "
        "response."
    )


async def test_with_thinking_on_a_final_tool_use_message_starts_with_thinking() -> None:
    api = FakeMessagesAPI()
    messages = (await conversation(api))[:5]
    messages[3]["content"] = [b for b in messages[3]["content"] if b["type"] == "tool_use"]
    message = await refused(api, request(messages=messages))
    assert message.startswith(
        "messages.3.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        "`tool_use`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block"
    )
    answer = await post(api.then(Script()), request(thinking=None, messages=messages))
    assert answer.status_code == 200, answer.text  # thinking off: no such rule


async def test_every_tool_use_is_answered_first_in_the_next_user_message() -> None:
    api = FakeMessagesAPI()
    messages = (await conversation(api))[:3]
    call = messages[2]["content"][0]["tool_use_id"]
    missing = "`tool_use` ids were found without `tool_result` blocks immediately after"
    unanswered = [*messages[:2], {"role": "user", "content": "go on"}]
    assert await refused(api, request(messages=unanswered)) == (
        f"messages.1: {missing}: {call}. Each `tool_use` block must have a corresponding "
        "`tool_result` block in the next message."
    )
    late = [
        *messages[:2],
        {"role": "user", "content": [{"type": "text", "text": "so"}, result(call)]},
    ]
    assert missing in await refused(api, request(messages=late))
    # Two user messages in a row are one turn: a result in the first still comes first.
    split = [*messages, {"role": "user", "content": "and?"}]
    assert (await post(api.then(Script()), request(messages=split))).status_code == 200


async def test_a_tool_result_answers_a_tool_use_of_the_message_before() -> None:
    api = FakeMessagesAPI()
    messages = await conversation(api)
    stray = [*messages[:-1], {"role": "user", "content": [result("toolu_01nothingxxxxxxxxxxxxxx")]}]
    assert await refused(api, request(messages=stray)) == (
        "messages.6.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
        "toolu_01nothingxxxxxxxxxxxxxx. Each `tool_result` block must have a corresponding "
        "`tool_use` block in the previous message."
    )
    opening = [{"role": "user", "content": [result("toolu_x")]}]
    assert "unexpected `tool_use_id`" in await refused(api, request(messages=opening))


# -- prompt caching --------------------------------------------------------------------------

LONG = "policy " * 400  # 2,800 bytes: 700 tokens, above the fixture's 256 minimum
MARK = {"type": "ephemeral"}


def cached_system() -> list[dict[str, Any]]:
    return [{"type": "text", "text": LONG, "cache_control": MARK}]


def turn(text: str, *, mark: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    return {"role": "user", "content": [{**block, "cache_control": MARK} if mark else block]}


async def test_cache_control_is_limited_to_four_breakpoints_and_never_on_thinking() -> None:
    api = FakeMessagesAPI()
    five = [turn(f"q{i}", mark=True) for i in range(4)]
    message = await refused(api, request(system=cached_system(), messages=five))
    assert message == "A maximum of 4 blocks with cache_control may be provided. Found 5."
    messages = (await conversation(api))[:3]
    for index, kind in ((0, "thinking"), (3, "redacted_thinking")):
        marked = copy.deepcopy(messages)
        marked[1]["content"][index]["cache_control"] = MARK
        assert await refused(api, request(messages=marked)) == (
            f"messages.1.content.{index}.{kind}.cache_control: Extra inputs are not permitted"
        )


async def test_usage_counts_cache_writes_and_reads_by_prefix(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.then(*[Script(blocks=[Text("ok")]) for _ in range(5)])
    system = estimate_tokens({"type": "text", "text": LONG})
    first: Any = request(system=cached_system(), messages=[turn("one")], thinking=None)
    usage = (await client.messages.create(**first)).usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (0, system)
    assert (
        usage.cache_creation is not None
        and usage.cache_creation.ephemeral_5m_input_tokens == system
    )
    # The next turn reads the system prompt back and writes up to its own last breakpoint.
    history = [turn("one"), {"role": "assistant", "content": "ok"}, turn(LONG, mark=True)]
    second: Any = request(system=cached_system(), messages=history, thinking=None)
    usage = (await client.messages.create(**second)).usage
    assert usage.cache_read_input_tokens == system
    written = usage.cache_creation_input_tokens
    assert written is not None and written > estimate_tokens(LONG) and usage.input_tokens == 0
    # The same request again reads all of it; another model has a cache of its own.
    usage = (await client.messages.create(**second)).usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
        system + written,
        0,
    )
    usage = (await client.messages.create(**{**second, "model": "claude-other"})).usage
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
        0,
        system + written,
    )
    # A prefix changed by one byte before the breakpoint is a miss.
    changed: Any = request(
        system=[{**cached_system()[0], "text": LONG + "!"}], messages=[turn("one")], thinking=None
    )
    usage = (await client.messages.create(**changed)).usage
    assert usage.cache_read_input_tokens == 0


async def test_a_hit_is_found_up_to_twenty_blocks_before_a_breakpoint(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.then(*[Script(blocks=[Text("ok")]) for _ in range(3)])
    await client.messages.create(**request(system=cached_system(), thinking=None))
    system = estimate_tokens({"type": "text", "text": LONG})

    def later(blocks: int) -> Any:
        content = [{"type": "text", "text": f"b{blocks}.{i}"} for i in range(blocks)]
        content[-1]["cache_control"] = MARK
        system_plain = [{"type": "text", "text": LONG}]
        return request(
            system=system_plain, messages=[{"role": "user", "content": content}], thinking=None
        )

    near = (await client.messages.create(**later(18))).usage  # system at 19 blocks back
    far = (await client.messages.create(**later(19))).usage  # at 20 blocks back: out of reach
    assert (near.cache_read_input_tokens, far.cache_read_input_tokens) == (system, 0)


async def test_a_prefix_below_the_minimum_is_not_cached() -> None:
    api = FakeMessagesAPI().then(Script(), Script())
    small = request(system=[{"type": "text", "text": "short", "cache_control": MARK}])
    for _ in range(2):
        usage = (await post(api, small)).json()["usage"]
        assert usage["cache_creation_input_tokens"] == usage["cache_read_input_tokens"] == 0


async def test_a_prompt_too_long_is_refused(
    claude: tuple[FakeMessagesAPI, anthropic.AsyncAnthropic],
) -> None:
    api, client = claude
    api.context_tokens = 100
    with pytest.raises(anthropic.BadRequestError) as raised:
        await client.messages.create(**request(messages=[turn(LONG)]))
    total = estimate_tokens({**turn(LONG)["content"][0], "role": "user"}) + estimate_tokens(
        {"settings": {"thinking": THINKING, "tool_choice": None}}
    )
    assert raised.value.api_message == f"prompt is too long: {total} tokens > 100 maximum"


def test_opaque_values_are_bound_to_their_model_and_text() -> None:
    assert signature_of("claude-test", "x") != signature_of("claude-other", "x")
    assert signature_of("claude-test", "x") != signature_of("claude-test", "x ")
    assert redacted_data("claude-test", "x") != redacted_data("claude-other", "x")
    sealed = base64.b64decode(redacted_data("claude-test", "x" * 30))
    assert b"xxx" not in sealed  # opaque, not readable
