"""The fake Responses API counts prompt-cache reads as OpenAI's automatic caching does: the
longest previously-seen exact prefix of the prompt, per model, of at least 1,024 tokens, in
increments of 128 tokens, reported as ``usage.input_tokens_details.cached_tokens``."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from service.providers.base import ProviderRequest, Reply
from tests.support.fakeapi import FakeResponsesAPI

URL = "https://fake.invalid/v1/responses"
# The prompt of a body whose only input is one user message: 66 bytes of settings
# ({"reasoning":null}{"instructions":null}{"tools":null}{"text":null}), then the message's
# canonical JSON, whose text starts 12 bytes in ({"content":"...).
BEFORE_TEXT = 66 + 12


def body(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": "gpt-test", "input": [{"content": text, "role": "user"}], **fields}


async def usage(api: FakeResponsesAPI, sent: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as client:
        answer = await client.post(URL, json=sent)
    assert answer.status_code == 200
    return dict(answer.json()["usage"])


async def test_a_short_prompt_keeps_the_flat_usage_and_caches_nothing() -> None:
    api = FakeResponsesAPI()
    for _ in range(2):
        got = await usage(api, body("hello " * 100))  # ~170 tokens, sent twice
        assert got["input_tokens"] == 10 and got["total_tokens"] == 15
        assert got["input_tokens_details"]["cached_tokens"] == 0


async def test_a_long_prompt_is_counted_and_its_first_request_reads_nothing() -> None:
    api = FakeResponsesAPI()
    got = await usage(api, body("x" * 6000))
    assert got["input_tokens"] == -(-(BEFORE_TEXT + 6000 + 17) // 4)  # + '","role":"user"}'
    assert got["input_tokens_details"]["cached_tokens"] == 0
    assert got["total_tokens"] == got["input_tokens"] + got["output_tokens"]


async def test_the_next_request_reads_the_longest_seen_prefix_in_128_token_steps() -> None:
    api = FakeResponsesAPI()
    await usage(api, body("x" * 6000))
    # Diverges at byte 78 + 5300 = 5378: 1,344 whole tokens in common, read back as 1,280.
    got = await usage(api, body("x" * 5300 + "y" * 700))
    assert got["input_tokens_details"]["cached_tokens"] == 1024 + 2 * 128
    # Diverging before 1,024 tokens (byte 4,096) reads nothing.
    got = await usage(api, body("x" * 3900 + "z" * 2100))
    assert got["input_tokens_details"]["cached_tokens"] == 0


async def test_a_conversation_reads_back_the_whole_previous_request_but_its_last_step() -> None:
    api = FakeResponsesAPI()
    first = body("x" * 6000)
    before = (await usage(api, first))["input_tokens"]
    reply = {"content": [{"text": "ok", "type": "output_text"}], "role": "assistant"}
    second = {**first, "input": [*first["input"], reply, {"content": "more", "role": "user"}]}
    got = await usage(api, second)
    read = got["input_tokens_details"]["cached_tokens"]
    assert read == 1024 + (before - 1024) // 128 * 128 and before - 128 < read <= before
    assert got["input_tokens"] > before


async def test_key_order_does_not_matter_but_a_changed_setting_or_model_does() -> None:
    api = FakeResponsesAPI()
    text = "x" * 6000
    await usage(api, body(text, instructions="Be brief."))
    reordered = {"input": [{"role": "user", "content": text}], "instructions": "Be brief."}
    assert (await usage(api, {**reordered, "model": "gpt-test"}))["input_tokens_details"][
        "cached_tokens"
    ] >= 1024
    for changed in (
        body(text, instructions="Be brief!"),  # a field before the history
        body(text, instructions="Be brief.", reasoning={"effort": "high"}),
        {**body(text, instructions="Be brief."), "model": "gpt-other"},
    ):
        got = await usage(api, changed)
        assert got["input_tokens_details"]["cached_tokens"] == 0, changed


async def test_the_provider_reports_the_cached_tokens_in_its_usage() -> None:
    api = FakeResponsesAPI()
    provider = api.provider()
    item = msgspec.Raw(msgspec.json.encode({"role": "user", "content": "x" * 6000}))
    replies = []
    for _ in range(2):
        async for event in provider.respond(ProviderRequest([item]), stream=False):
            assert isinstance(event, Reply)
            replies.append(event)
    await provider.close()
    first, second = (reply.usage for reply in replies)
    assert first is not None and first.cached_tokens == 0
    assert (
        second is not None
        and second.cached_tokens == 1024 + (first.input_tokens - 1024) // 128 * 128
    )
