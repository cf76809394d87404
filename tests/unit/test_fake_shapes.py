"""The fakes are shaped like the real Responses API where a client can tell: ids are a prefix
and 48 hex digits (as OpenAI's: a fake with shorter ids hid that turnstore read such ids as its
own), every item parses as the SDK's type, and a stream announces the reasoning item before
the text. For the built-in fake (``make run``'s provider) and the fake Responses API of the
tests (tests/support/fakeapi.py), whose wire format tests/unit/test_fakeapi_wire_format.py checks whole.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from pydantic import BaseModel

from service.core.items import user_input_item
from service.providers.base import ItemDone, ProviderRequest, Reply, TextDelta
from service.providers.fake import FakeProvider
from tests.support.fakeapi import FakeResponsesAPI, Script

OPENAI_ID = re.compile(r"(rs|msg|fc|cmp|resp)_[0-9a-f]{48}")
TYPES: dict[str, type[BaseModel]] = {
    "reasoning": ResponseReasoningItem,
    "message": ResponseOutputMessage,
    "function_call": ResponseFunctionToolCall,
}
TOOL = msgspec.Raw(b'[{"type":"function","name":"lookup","parameters":{"type":"object"}}]')


def check(item: dict[str, Any]) -> None:
    assert OPENAI_ID.fullmatch(item["id"]), item["id"]
    if item["type"] in TYPES:  # as the SDK parses it, nothing coerced
        parsed = TYPES[item["type"]].model_validate(item, strict=True)
        assert parsed.model_dump(exclude_none=True) == {
            k: v for k, v in item.items() if v is not None
        }


async def events(request: ProviderRequest, *, stream: bool) -> list[Any]:
    return [event async for event in FakeProvider().respond(request, stream=stream)]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_built_in_fake_answers_with_openai_shaped_items(stream: bool) -> None:
    said = await events(ProviderRequest([user_input_item("hello")]), stream=stream)
    reply = said[-1]
    assert isinstance(reply, Reply)
    items = [msgspec.json.decode(item) for item in reply.output_items]
    assert [item["type"] for item in items] == ["reasoning", "message"]
    for item in items:
        check(item)
    if stream:  # the reasoning item first, whole, then the text
        assert isinstance(said[0], ItemDone) and said[0].item == reply.output_items[0]
        assert all(isinstance(event, TextDelta) for event in said[1:-1]) and len(said) > 3
        assert {event.item_id for event in said[1:-1]} == {items[1]["id"]}  # type: ignore[union-attr]
    called = await events(ProviderRequest([user_input_item("lookup x")], tools=TOOL), stream=stream)
    call = [msgspec.json.decode(item) for item in called[-1].output_items]
    assert [item["type"] for item in call] == ["reasoning", "function_call"]
    for item in call:
        check(item)


async def test_the_built_in_fakes_compaction_item_has_an_openai_id_and_comes_back() -> None:
    fake = FakeProvider()
    history = [user_input_item("one"), user_input_item("two")]
    compacted = await fake.compact(ProviderRequest(history))
    item = msgspec.json.decode(compacted.items[-1])
    assert item["type"] == "compaction" and OPENAI_ID.fullmatch(item["id"])
    again = await events(
        ProviderRequest([*compacted.items, user_input_item("three")]), stream=False
    )
    assert again[-1].text.endswith("(history=2, compacted=2)")


async def test_the_fake_responses_api_mints_openai_shaped_ids() -> None:
    api = FakeResponsesAPI().then(Script(calls=[("f", "{}")]), Script())
    provider = api.provider()
    try:
        for _ in range(2):
            said = [
                event
                async for event in provider.respond(
                    ProviderRequest([user_input_item("x")]), stream=True
                )
            ]
            for item in said[-1].output_items:
                check(msgspec.json.decode(item))
        compacted = await provider.compact(ProviderRequest([user_input_item("x")]))
        check(msgspec.json.decode(compacted.items[-1]))
    finally:
        await provider.close()
