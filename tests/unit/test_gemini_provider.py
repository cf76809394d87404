"""Gemini's parts (service/core/translate/gemini_parts.py) and its adapter (service/providers/gemini.py)
against the strict fake (tests/support/fake_gemini.py): parts kept as sent and told from
Responses items by their first bytes, a stream joined into the whole reply's parts, each
provider's items translated with the same call ids, Google's errors mapped."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    InvalidEncryptedContent,
    ProviderRefused,
    RateLimited,
)
from service.core.items import function_call_output, function_calls, user_input_item
from service.core.model import key_id
from service.core.translate import for_form, is_opaque, neutral, readable
from service.core.translate.gemini_parts import (
    GEMINI,
    PLACEHOLDER_SIGNATURE,
    is_part,
    to_contents,
    wire,
)
from service.providers.base import ProviderRequest, Reply
from service.providers.gemini import GeminiEndpoint, GeminiProvider
from service.providers.wire import WireLimits
from tests.support.fake_gemini import API_KEY, Call, FakeGeminiAPI, Script, Text, Thought

MODEL = "gemini-3-test"


def raw(text: str) -> msgspec.Raw:
    return msgspec.Raw(text.encode())


def item(**fields: object) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(fields))


THOUGHT = raw('{\n  "text": "Let me see.",\n  "thought": true,\n  "thoughtSignature": "c2ln"\n}')
CALL = raw(
    '{"turnstore_call_id":"call_1",\n  "functionCall": {"name": "weather", "args": {"city": "Oslo"}},'
    '\n  "thoughtSignature": "Y2FsbA=="\n}'
)
TEXT = raw('{"text": "Sunny."}')


def provider(api: FakeGeminiAPI, api_key: str = API_KEY) -> GeminiProvider:
    return GeminiProvider(
        GeminiEndpoint("google", "https://gemini.invalid", api_key, MODEL),
        WireLimits(1.0, 5.0, 262_144),
        transport=httpx.MockTransport(api.handle),
    )


async def reply_of(gemini: GeminiProvider, request: ProviderRequest, *, stream: bool) -> Reply:
    got = [event async for event in gemini.respond(request, stream=stream)]
    assert isinstance(got[-1], Reply)
    return got[-1]


def test_a_part_is_told_by_its_first_bytes_and_a_responses_item_never_passes() -> None:
    assert is_part(THOUGHT) and is_part(CALL) and is_part(TEXT)
    assert not is_part(item(type="message", role="user", content="hi"))
    assert not is_part(item(text="looks like a part", role="user", content="hi"))  # the fallback
    assert not is_part(raw('{"type":"text","text":"an Anthropic block"}'))


def test_a_minted_call_id_is_never_sent_and_the_part_goes_back_byte_for_byte() -> None:
    assert bytes(wire(CALL)) == (
        b'{\n  "functionCall": {"name": "weather", "args": {"city": "Oslo"}},'
        b'\n  "thoughtSignature": "Y2FsbA=="\n}'
    )
    assert wire(TEXT) is TEXT
    [call] = function_calls([THOUGHT, CALL, TEXT])
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_1",
        "weather",
        {"city": "Oslo"},
    )


def test_thought_and_signed_parts_are_opaque_and_another_origin_gets_them_translated() -> None:
    assert is_opaque(THOUGHT) and is_opaque(CALL) and not is_opaque(TEXT)
    assert neutral(THOUGHT) == []
    [call] = neutral(CALL)
    translated = json.loads(bytes(call))
    assert translated == {
        "type": "function_call",
        "call_id": "call_1",
        "name": "weather",
        "arguments": '{"city": "Oslo"}',
    }
    assert readable(THOUGHT) == [
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Let me see."}],
        }
    ]


def test_gemini_gets_its_parts_verbatim_and_everything_else_translated_with_the_same_ids() -> None:
    claude_call = raw('{"type":"tool_use","id":"toolu_1","name":"weather","input":{"city":"Rome"}}')
    items = [
        item(type="message", role="developer", content="Be brief."),
        user_input_item("Weather?"),
        THOUGHT,
        CALL,
        function_call_output("call_1", "18C"),
        item(type="message", role="user", content="And Rome?"),
        claude_call,
        function_call_output("toolu_1", "20C"),
        item(type="reasoning", id="rs_1", summary=[], encrypted_content="sealed"),
    ]
    contents = to_contents(for_form(items, GEMINI), MODEL)
    sent = msgspec.json.encode(contents.contents)
    assert bytes(wire(CALL)) in sent and bytes(THOUGHT) in sent  # spliced as kept
    assert contents.system == ["Be brief."]
    decoded = json.loads(sent)
    assert [c["role"] for c in decoded] == ["user", "model", "user", "model", "user"]
    assert decoded[2]["parts"] == [
        {"functionResponse": {"name": "weather", "response": {"output": "18C"}}},  # no id
        {"text": "And Rome?"},
    ]
    assert decoded[3]["parts"] == [
        {
            "functionCall": {"id": "toolu_1", "name": "weather", "args": {"city": "Rome"}},
            "thoughtSignature": PLACEHOLDER_SIGNATURE,  # Gemini 3: a call it never issued
        }
    ]
    assert decoded[4]["parts"][0]["functionResponse"]["id"] == "toolu_1"
    older = json.loads(
        msgspec.json.encode(to_contents(for_form(items, GEMINI), "gemini-2.5-flash").contents)
    )
    assert "thoughtSignature" not in older[3]["parts"][0]


@pytest.mark.parametrize("signature_first", [False, True])
async def test_a_stream_keeps_the_parts_the_whole_reply_has(signature_first: bool) -> None:
    script = [
        Thought("One."),
        Thought("Two."),
        Text("A long answer in pieces"),
        Call("f", {"a": 1}),
    ]
    api = FakeGeminiAPI()
    gemini = provider(api)
    fields = {"reasoning": msgspec.Raw(b'{"summary":"auto"}')}
    request = ProviderRequest([user_input_item("hi")], fields=fields)
    api.then(Script(list(script), deltas=4, signature_first=signature_first))
    streamed = await reply_of(gemini, request, stream=True)
    api.then(Script(list(script)))
    whole = await reply_of(gemini, request, stream=False)
    as_read = [json.loads(bytes(wire(i))) for i in streamed.output_items]
    assert as_read == [json.loads(bytes(wire(i))) for i in whole.output_items] == api.issued[-4:]
    assert streamed.text == whole.text == "A long answer in pieces"
    assert streamed.usage == whole.usage and whole.usage is not None
    assert whole.usage.reasoning_tokens and whole.usage.output_tokens > whole.usage.reasoning_tokens
    assert b"\n" in bytes(whole.output_items[0])  # a whole reply's part: the bytes Gemini sent


async def test_a_signature_moved_to_another_part_is_refused_and_retried_without() -> None:
    api = FakeGeminiAPI()
    gemini = provider(api)
    api.then(Script([Call("f"), Text("done", signed=False)]))
    first = await reply_of(gemini, ProviderRequest([user_input_item("hi")]), stream=False)
    call, text = (json.loads(bytes(wire(i))) for i in first.output_items)
    text["thoughtSignature"] = call.pop("thoughtSignature")
    moved = [user_input_item("hi"), item(**call), item(**text), user_input_item("again")]
    with pytest.raises(InvalidEncryptedContent):
        await reply_of(gemini, ProviderRequest(moved), stream=False)
    assert api.refusals[-1] == "Corrupted thought signature."


@pytest.mark.parametrize(
    ("script", "error"),
    [
        (Script(http_status=429, retry_delay="2.5s"), RateLimited),
        (
            Script(
                http_status=400,
                message="The input token count (9) exceeds the maximum number of tokens allowed (5).",
            ),
            ContextLengthExceeded,
        ),
        (
            Script(
                http_status=400,
                message="* GenerateContentRequest.generation_config.temperature: out of range",
            ),
            ProviderRefused,
        ),
        (Script(block_reason="OTHER"), ContentFiltered),
        (Script(finish_reason="SPII"), ContentFiltered),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_googles_answers_map_to_the_contracts_errors(
    script: Script, error: type[Exception], stream: bool
) -> None:
    api = FakeGeminiAPI().then(script)
    with pytest.raises(error) as raised:
        await reply_of(provider(api), ProviderRequest([user_input_item("hi")]), stream=stream)
    found: Any = raised.value
    if isinstance(found, RateLimited):
        assert found.retry_after == "3"
    if isinstance(found, ProviderRefused):
        assert found.param == "temperature"
    assert API_KEY not in str(found)


def test_origin_records_the_kind_and_the_keys_fingerprint_never_the_key() -> None:
    llm = provider(FakeGeminiAPI())
    assert llm.origin.kind == "gemini"
    assert llm.origin.key_fingerprint == key_id(API_KEY)
    other_model = llm.origin_for("gemini-2.5-flash")
    assert API_KEY not in repr(llm.origin) and API_KEY not in repr(other_model)
    assert other_model.key_fingerprint == key_id(API_KEY)
    other = provider(FakeGeminiAPI(), api_key="AIza-another")
    assert other.origin.key_fingerprint != llm.origin.key_fingerprint
    assert other.origin == llm.origin  # a rotated key opens what the old one was given
