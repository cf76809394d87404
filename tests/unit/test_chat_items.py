"""Chat Completions assistant messages among a conversation's items
(service/core/translate/chat_messages.py and the seam that reads it, translate/__init__.py): told from Responses
items, sent to their own origin verbatim and to any other without their thinking, listed on
/v1 as their parts, each under an id of its own."""

from __future__ import annotations

import json
import os
import uuid

import msgspec
import pytest

from service.app import build_provider, check_provider
from service.core.ids import Ids
from service.core.items import (
    function_calls,
    listed,
    open_calls,
    restorable,
    without_last_item,
)
from service.core.model import Origin, Turn
from service.core.translate import for_form, is_opaque, neutral, to_items
from service.core.translate.anthropic_blocks import ANTHROPIC, to_messages
from service.core.translate.chat_messages import is_chat, reasoning_id, to_chat
from service.core.window import Budget, choose_window
from service.platform.settings import Settings
from service.providers.chat_completions import ChatProvider


def raw(text: str) -> msgspec.Raw:
    return msgspec.Raw(text.encode())


def item(**fields: object) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(fields))


# As vLLM sends them: its key order, null extras, the thinking last.
VLLM = raw(
    '{"role":"assistant","content":"Checking.","refusal":null,"annotations":null,"audio":null,'
    '"function_call":null,"tool_calls":[{"id":"chatcmpl-tool-1a","type":"function",'
    '"function":{"name":"weather","arguments":"{\\"city\\":\\"Oslo\\"}"}}],'
    '"reasoning_content":"The user wants weather."}'
)
OLLAMA = raw('{"role":"assistant","content":"Sunny.","reasoning":"Easy."}')
CALLS_ONLY = raw(
    '{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}'
)
ASKED = item(type="message", role="user", content="Weather in Oslo?")
ANSWERED = item(type="function_call_output", call_id="chatcmpl-tool-1a", output="18C")


@pytest.mark.parametrize(
    ("text", "chat"),
    [
        (bytes(VLLM).decode(), True),
        (bytes(OLLAMA).decode(), True),
        (bytes(CALLS_ONLY).decode(), True),
        ('{"role":"assistant","content":null}', True),
        ('{"role":"assistant","content":"hi"}', False),  # the Responses short form: the same
        ('{"role":"assistant","content":[{"type":"output_text","text":"hi"}]}', False),
        ('{"role":"assistant","type":"message","content":"x","tool_calls":[]}', False),
        ('{"type":"message","role":"assistant","content":"hi","reasoning":"x"}', False),
        ('{"role":"user","content":"hi","reasoning":"x"}', False),
        ('{"type":"text","text":"hi"}', False),
    ],
)
def test_a_chat_message_is_told_from_a_responses_item(text: str, chat: bool) -> None:
    assert is_chat(raw(text)) is chat


def test_its_tool_calls_are_function_calls_and_they_outlive_its_thinking() -> None:
    [call] = function_calls([VLLM])
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "chatcmpl-tool-1a",
        "weather",
        {"city": "Oslo"},
    )
    assert open_calls([ASKED, VLLM]) == {"chatcmpl-tool-1a"}
    assert open_calls([ASKED, VLLM, ANSWERED]) == set()
    # Its thinking is its issuer's alone; its text and calls stay when its thinking goes.
    assert is_opaque(VLLM) and not is_opaque(CALLS_ONLY)
    assert [json.loads(bytes(i))["type"] for i in neutral(VLLM)] == ["message", "function_call"]


def test_other_providers_read_its_text_and_calls_never_its_thinking() -> None:
    responses = [json.loads(bytes(i)) for i in to_items([ASKED, VLLM, ANSWERED, OLLAMA])]
    assert [i.get("type") for i in responses] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert responses[2]["call_id"] == "chatcmpl-tool-1a"
    assert "The user wants" not in json.dumps(responses) and "Easy." not in json.dumps(responses)
    claude = to_messages(for_form([ASKED, VLLM, ANSWERED], ANTHROPIC)).messages
    blocks = json.loads(msgspec.json.encode(claude))
    assert blocks[1]["content"] == [
        {"type": "text", "text": "Checking."},
        {
            "type": "tool_use",
            "id": "chatcmpl-tool-1a",
            "name": "weather",
            "input": {"city": "Oslo"},
        },
    ]
    assert blocks[2]["content"][0]["tool_use_id"] == "chatcmpl-tool-1a"
    plain = [ASKED]
    assert to_items(plain) is plain  # no Chat message: the list itself, as before


def test_a_turn_of_another_origin_sends_it_without_its_thinking() -> None:
    vllm = Origin("vllm", "http://vllm/v1/chat/completions", "qwen")
    turn = Turn("q", "a", [ASKED, VLLM, ANSWERED, OLLAMA], origin=vllm, number=1)
    same = choose_window([turn], 1, vllm, 100, Budget()).items
    assert same == [ASKED, VLLM, ANSWERED, OLLAMA]  # verbatim, the same objects
    other = choose_window([turn], 1, vllm.with_model("llama"), 100, Budget()).items
    sent = json.dumps([json.loads(bytes(i)) for i in other])
    assert "The user wants" not in sent and "Easy." not in sent
    [call] = json.loads(bytes(VLLM))["tool_calls"]
    assert function_calls(other) == function_calls([VLLM])  # the same id, name and arguments
    assert call["id"] in sent


def test_on_v1_it_is_listed_as_its_parts_each_under_its_own_id() -> None:
    ids = Ids(os.urandom(32))
    cid = uuid.uuid4()
    shown = listed(ids, cid, 3, [ASKED, VLLM, ANSWERED, OLLAMA])
    kinds = [json.loads(bytes(part)).get("type") for _, part in shown]
    assert kinds == [
        "message",
        "reasoning",
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "message",
    ]
    assert len({item_id for item_id, _ in shown}) == len(shown)
    reasoning = json.loads(bytes(shown[1][1]))
    assert reasoning["summary"] == [{"type": "summary_text", "text": "The user wants weather."}]
    assert "encrypted_content" not in reasoning  # never shown in clear
    hidden = listed(ids, cid, 3, [ASKED, VLLM, ANSWERED], own_calls={"chatcmpl-tool-1a"})
    kinds = [json.loads(bytes(p)).get("type") for _, p in hidden]
    assert kinds == ["message", "reasoning", "message"]  # turnstore's own call and its output
    # Restored by reference, the thinking part brings the whole message back, byte for byte.
    parts = {own: part for own, part, _ in restorable(VLLM)}
    assert parts[reasoning_id("The user wants weather.")] is VLLM


def test_removing_a_chat_answer_keeps_the_transcript_readable() -> None:
    turn = Turn(
        "q",
        "Sunny.",
        [ASKED, OLLAMA],
        transcript=(("user", "Weather in Oslo?"), ("assistant", "Sunny.")),
    )
    popped = without_last_item(turn)
    assert popped.replay_items == [ASKED] and popped.transcript == (("user", "Weather in Oslo?"),)


def test_llm_provider_chat_needs_a_base_url_and_a_model_and_a_key_is_optional() -> None:
    settings = Settings(
        llm_provider="chat", chat_base_url="http://localhost:8001/v1", chat_model="qwen"
    )
    provider = build_provider(settings)
    assert (
        isinstance(provider, ChatProvider)
        and provider.origin.endpoint == "http://localhost:8001/v1/chat/completions"
    )
    with pytest.raises(ValueError, match="CHAT_BASE_URL and CHAT_MODEL"):
        check_provider(Settings(llm_provider="chat", chat_model="qwen"))
    with pytest.raises(Exception, match="must not carry credentials"):
        Settings(llm_provider="chat", chat_base_url="http://u:p@host/v1", chat_model="q")


def test_an_output_whose_call_left_the_window_goes_as_text_not_an_orphan_tool_message() -> None:
    """A tool message must follow its call: an output whose call is not in the request (the
    window left that turn out) goes as the user's text; one whose call is there, as a tool
    message of its id."""
    output = {"type": "function_call_output", "call_id": "call_gone", "output": "sunny"}
    [message] = to_chat([msgspec.Raw(json.dumps(output).encode())]).messages
    assert message == {"role": "user", "content": "[output of call call_gone]\nsunny"}
    call = {"type": "function_call", "call_id": "call_here", "name": "w", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "call_here", "output": "rain"}
    items = [msgspec.Raw(json.dumps(item).encode()) for item in (call, answer)]
    _, tool = to_chat(items).messages
    assert tool == {"role": "tool", "tool_call_id": "call_here", "content": "rain"}
