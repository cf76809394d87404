"""Responses items and Anthropic content blocks (service/core/translate/anthropic_blocks.py): each
provider's items go to it byte for byte, and to any other provider translated, its thinking
left out."""

from __future__ import annotations

import json

import msgspec
import pytest

from service.core.errors import InvalidInput
from service.core.items import function_calls
from service.core.model import Origin, Turn
from service.core.translate import is_opaque, to_items
from service.core.translate.anthropic_blocks import to_messages
from service.core.window import Budget, choose_window
from service.providers.base import ProviderRequest, encode_request


def raw(text: str) -> msgspec.Raw:
    return msgspec.Raw(text.encode())


def item(**fields: object) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(fields))


# Blocks as Anthropic sent them: its own key order and spacing, which no re-encoding keeps.
THINKING = raw('{"type":"thinking", "thinking":"Let me look.","signature":"c2ln/AB+=="}')
EMPTY_THINKING = raw('{"type":"thinking","thinking":"","signature":"ZW1wdHk="}')
REDACTED = raw('{"type":"redacted_thinking","data":"cmVkYWN0ZWQ="}')
TOOL_USE = raw('{"type":"tool_use","id":"toolu_01A","name":"weather","input":{"city":"Oslo"}}')
TEXT = raw('{"type":"text","text":"Sunny.","citations":null}')


def test_a_claude_turn_goes_back_to_claude_byte_for_byte_in_one_assistant_message() -> None:
    asked = item(type="message", role="user", content="Weather in Oslo?")
    answered = item(type="function_call_output", call_id="toolu_01A", output="18C, sun")
    thanks = item(type="message", role="user", content=[{"type": "input_text", "text": "Thanks"}])
    items = [asked, THINKING, EMPTY_THINKING, REDACTED, TOOL_USE, answered, THINKING, TEXT, thanks]
    sent = msgspec.json.encode(to_messages(items).messages)
    for block in (THINKING, EMPTY_THINKING, REDACTED, TOOL_USE, TEXT):
        assert bytes(block) in sent  # spliced as it came: never decoded and encoded again
    decoded = json.loads(sent)
    assert [m["role"] for m in decoded] == ["user", "assistant", "user", "assistant", "user"]
    kinds = ["thinking", "thinking", "redacted_thinking", "tool_use"]
    assert [b["type"] for b in decoded[1]["content"]] == kinds
    result = decoded[2]["content"]
    assert result == [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "18C, sun"}]
    assert decoded[4]["content"] == [{"type": "text", "text": "Thanks"}]


def test_another_providers_turn_is_translated_with_the_same_call_ids() -> None:
    items = [
        item(type="message", role="developer", content="Be brief."),
        item(type="message", role="user", content="Weather?"),
        item(type="function_call", call_id="call_9", name="weather", arguments='{"city":"Oslo"}'),
        item(type="function_call_output", call_id="call_9", output="sun"),
        item(type="message", role="user", content="And tomorrow?"),
        item(type="message", role="assistant", content=[{"type": "output_text", "text": "Rain."}]),
        item(type="reasoning", id="rs_1", summary=[], encrypted_content="sealed"),
    ]
    messages = to_messages(items)
    assert messages.system == ["Be brief."]
    decoded = json.loads(msgspec.json.encode(messages.messages))
    assert decoded == [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_9", "name": "weather", "input": {"city": "Oslo"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_9", "content": "sun"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Rain."}]},
    ]


def test_an_item_anthropic_cannot_take_is_refused_naming_the_input() -> None:
    with pytest.raises(InvalidInput) as refused:
        to_messages([item(type="item_reference", id="msg_1")])
    assert refused.value.param == "input"


def test_claudes_blocks_go_to_the_responses_api_translated_and_without_thinking() -> None:
    user = item(type="message", role="user", content="Weather?")
    plain = [user, item(type="function_call_output", call_id="c", output="x")]
    assert to_items(plain) is plain  # most requests hold no block: nothing is rebuilt
    translated = [
        json.loads(bytes(i)) for i in to_items([user, THINKING, REDACTED, TOOL_USE, TEXT])
    ]
    assert translated == [
        {"type": "message", "role": "user", "content": "Weather?"},
        {
            "type": "function_call",
            "call_id": "toolu_01A",
            "name": "weather",
            "arguments": '{"city":"Oslo"}',
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}],
        },
    ]


def test_thinking_is_opaque_and_a_tool_use_is_a_function_call() -> None:
    assert is_opaque(THINKING) and is_opaque(EMPTY_THINKING) and is_opaque(REDACTED)
    assert not is_opaque(TEXT) and not is_opaque(TOOL_USE)
    calls = function_calls([THINKING, TOOL_USE, TEXT])
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("toolu_01A", "weather", {"city": "Oslo"})
    ]


def test_files_go_to_claude_as_documents_and_one_in_openais_storage_is_refused() -> None:
    pdf = "data:application/pdf;base64,JVBERi0xLjQ="
    parts = [
        {"type": "input_text", "text": "Read these"},
        {"type": "input_file", "file_data": pdf, "filename": "a.pdf"},
        {"type": "input_file", "file_url": "https://example.com/b.pdf"},
    ]
    sent = to_messages([item(type="message", role="user", content=parts)]).messages
    assert json.loads(msgspec.json.encode(sent))[0]["content"][1:] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQ="},
            "title": "a.pdf",
        },
        {"type": "document", "source": {"type": "url", "url": "https://example.com/b.pdf"}},
    ]
    stored = [{"type": "input_file", "file_id": "file-abc"}]
    with pytest.raises(InvalidInput) as refused:
        to_messages([item(type="message", role="user", content=stored)])
    assert refused.value.param == "input"


def _raw(item: dict[str, object]) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(item).encode())


def test_an_output_whose_call_left_the_window_goes_as_text_not_a_dangling_result() -> None:
    """A tool_result must answer a tool_use of the request: an output whose call is not in it
    (the window left that turn out) is sent as the user's text, as to Gemini."""
    output = _raw({"type": "function_call_output", "call_id": "call_gone", "output": "sunny"})
    [message] = to_messages([output]).messages
    assert message["role"] == "user"
    assert message["content"] == [{"type": "text", "text": "[output of call call_gone]\nsunny"}]
    call = _raw({"type": "function_call", "call_id": "call_here", "name": "w", "arguments": "{}"})
    answer = _raw({"type": "function_call_output", "call_id": "call_here", "output": "rain"})
    _, answered = to_messages([call, answer]).messages
    assert answered["content"][0]["type"] == "tool_result"


def test_a_window_is_known_plain_only_when_its_turns_hold_no_block() -> None:
    """A window's Responses items are not looked at again for each request (Window.plain);
    a turn of the same origin that holds a block (an import) still has it translated."""
    origin = Origin("openai", "https://api.openai.com/v1/responses", "gpt")
    asked = item(type="message", role="user", content="Weather?")
    plain_turn = Turn("q", "a", [asked], origin=origin, number=1)
    with_blocks = Turn("q", "a", [asked, THINKING, TOOL_USE], origin=origin, number=2)

    def sent(turns: list[Turn]) -> tuple[bool, list[dict[str, object]]]:
        window = choose_window(turns, 1, origin, 0, Budget())
        known = len(window.items) if window.plain else 0
        body = encode_request("gpt", ProviderRequest(window.items, plain=known), stream=False)
        return window.plain, json.loads(body)["input"]

    assert sent([plain_turn]) == (True, [json.loads(bytes(asked))])
    plain, items = sent([plain_turn, with_blocks])
    assert not plain
    assert [i["type"] for i in items] == ["message", "message", "function_call"]
