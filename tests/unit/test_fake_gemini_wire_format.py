"""The strict fake Gemini API (tests/support/fake_gemini.py) as the official ``google-genai``
SDK reads it: every answer parses into the SDK's types, streamed and not, with the fields
turnstore reads (thought parts, signatures on the part they came with, calls, usage, finish
and block reasons, Google's error body), and the SDK's own requests pass the fake's checks."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors, types

from tests.support.fake_gemini import (
    API_KEY,
    Call,
    FakeGeminiAPI,
    Script,
    Text,
    Thought,
    signature_of,
)

MODEL = "gemini-3-test"


@asynccontextmanager
async def client(api: FakeGeminiAPI) -> AsyncIterator[genai.Client]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(api.handle)) as http:
        options = types.HttpOptions(
            base_url="https://gemini.invalid",
            api_version="v1beta",  # what turnstore calls (the SDK defaults to v1)
            httpx_async_client=http,
            retry_options=types.HttpRetryOptions(attempts=1),
        )
        yield genai.Client(api_key=API_KEY, http_options=options)


THINKING = types.GenerateContentConfig(
    thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_level="LOW"),
    tools=[
        types.Tool(
            function_declarations=[
                types.FunctionDeclaration(name="weather", parameters_json_schema={"type": "object"})
            ]
        )
    ],
)


def parts_of(response: types.GenerateContentResponse) -> list[types.Part]:
    assert response.candidates and response.candidates[0].content
    return response.candidates[0].content.parts or []


async def test_a_whole_reply_parses_with_its_thoughts_signatures_and_usage() -> None:
    api = FakeGeminiAPI().then(Script([Thought("hm"), Text("Hello")]))
    async with client(api) as sdk:
        response = await sdk.aio.models.generate_content(
            model=MODEL, contents="Hi", config=THINKING
        )
    thought, text = parts_of(response)
    assert thought.thought and thought.text == "hm" and thought.thought_signature
    assert text.text == "Hello" and not text.thought
    issued = api.issued[1]
    assert text.thought_signature == base64.b64decode(signature_of(MODEL, issued))
    assert response.candidates and response.candidates[0].finish_reason == types.FinishReason.STOP
    usage = response.usage_metadata
    assert usage and usage.prompt_token_count and usage.thoughts_token_count
    assert usage.total_token_count == (
        usage.prompt_token_count + (usage.candidates_token_count or 0) + usage.thoughts_token_count
    )
    assert api.headers[-1]["x-goog-api-key"] == API_KEY  # the SDK sends the key so too


async def test_a_stream_parses_chunk_by_chunk_and_joins_to_the_whole_reply() -> None:
    api = FakeGeminiAPI().then(Script([Thought("thinking hard"), Text("Hello there")]))
    async with client(api) as sdk:
        chunks = [
            chunk
            async for chunk in await sdk.aio.models.generate_content_stream(
                model=MODEL, contents="Hi", config=THINKING
            )
        ]
    assert "alt=sse" in api.urls[-1]
    parts = [part for chunk in chunks for part in parts_of(chunk)]
    thought = "".join(p.text or "" for p in parts if p.thought)
    text = "".join(p.text or "" for p in parts if not p.thought)
    assert (thought, text) == ("thinking hard", "Hello there")
    signatures = [p.thought_signature for p in parts if p.thought_signature]
    assert len(signatures) == 2  # each on an empty text after its part's pieces
    assert chunks[-1].candidates and chunks[-1].candidates[0].finish_reason == "STOP"
    assert chunks[-1].usage_metadata and chunks[-1].usage_metadata.thoughts_token_count


async def test_calls_parse_with_the_first_ones_signature_and_a_reply_answers_them() -> None:
    api = FakeGeminiAPI(call_ids=True).then(
        Script([Call("weather", {"city": "Oslo"}), Call("weather", {"city": "Rome"})]),
        Script([Text("Sunny in both.")]),
    )
    async with client(api) as sdk:
        chat = sdk.aio.chats.create(model=MODEL, config=THINKING)
        first = await chat.send_message("Weather in Oslo and Rome?")
        calls = [p.function_call for p in parts_of(first) if p.function_call]
        assert [(c.name, c.args) for c in calls] == [
            ("weather", {"city": "Oslo"}),
            ("weather", {"city": "Rome"}),
        ]
        assert parts_of(first)[0].thought_signature and not parts_of(first)[1].thought_signature
        answers = [
            types.Part(
                function_response=types.FunctionResponse(
                    id=c.id, name=c.name, response={"output": "sun"}
                )
            )
            for c in calls
        ]
        second = await chat.send_message(answers)  # the SDK replays the signed call
    assert second.text == "Sunny in both."
    assert api.refusals == []


async def test_a_blocked_prompt_and_a_filtered_reply_parse_as_google_sends_them() -> None:
    api = FakeGeminiAPI().then(Script(block_reason="SAFETY"), Script(finish_reason="SAFETY"))
    async with client(api) as sdk:
        blocked = await sdk.aio.models.generate_content(model=MODEL, contents="x")
        filtered = await sdk.aio.models.generate_content(model=MODEL, contents="y")
    assert blocked.prompt_feedback and blocked.prompt_feedback.block_reason == "SAFETY"
    assert not blocked.candidates
    assert filtered.candidates and filtered.candidates[0].finish_reason == "SAFETY"


@pytest.mark.parametrize(
    ("script", "code", "status"),
    [
        (Script(http_status=429), 429, "RESOURCE_EXHAUSTED"),
        (Script(http_status=500), 500, "INTERNAL"),
        (Script(http_status=503), 503, "UNAVAILABLE"),
    ],
)
async def test_errors_are_googles_body_as_the_sdk_raises_it(
    script: Script, code: int, status: str
) -> None:
    api = FakeGeminiAPI().then(script)
    async with client(api) as sdk:
        with pytest.raises(errors.APIError) as raised:
            await sdk.aio.models.generate_content(model=MODEL, contents="x")
    assert raised.value.code == code and raised.value.status == status
    if code == 429:
        details: Any = raised.value.details
        assert details["error"]["details"][0]["retryDelay"] == "7s"


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (
            [
                types.Content(role="user", parts=[types.Part(text="hi")]),
                types.Content(
                    role="model",
                    parts=[types.Part(function_call=types.FunctionCall(name="f", args={}))],
                ),
                types.Content(
                    role="user",
                    parts=[
                        types.Part(function_response=types.FunctionResponse(name="f", response={}))
                    ],
                ),
            ],
            "Function call is missing a thought_signature in functionCall parts",
        ),
        (
            [
                types.Content(role="user", parts=[types.Part(text="hi")]),
                types.Content(
                    role="model",
                    parts=[types.Part(text="forged", thought_signature=b"\x12\x30forged")],
                ),
                types.Content(role="user", parts=[types.Part(text="more")]),
            ],
            "Corrupted thought signature.",
        ),
        (
            [types.Content(role="user", parts=[])],
            "contents.parts must not be empty",
        ),
    ],
)
async def test_the_fake_refuses_what_gemini_refuses(contents: Any, message: str) -> None:
    api = FakeGeminiAPI()
    async with client(api) as sdk:
        with pytest.raises(errors.ClientError) as raised:
            await sdk.aio.models.generate_content(model=MODEL, contents=contents)
    assert raised.value.code == 400 and message in (raised.value.message or "")


async def test_a_wrong_key_and_an_unknown_model_are_refused_as_google_does() -> None:
    api = FakeGeminiAPI(api_key="another")
    async with client(api) as sdk:
        with pytest.raises(errors.ClientError) as wrong:
            await sdk.aio.models.generate_content(model=MODEL, contents="x")
    assert wrong.value.code == 400 and "API key not valid" in (wrong.value.message or "")
    async with client(FakeGeminiAPI()) as sdk:
        with pytest.raises(errors.ClientError) as unknown:
            await sdk.aio.models.generate_content(model="gemini-9", contents="x")
    assert unknown.value.code == 404 and unknown.value.status == "NOT_FOUND"


async def test_count_tokens_parses() -> None:
    api = FakeGeminiAPI()
    async with client(api) as sdk:
        counted = await sdk.aio.models.count_tokens(model=MODEL, contents="hello there")
    assert counted.total_tokens and counted.total_tokens > 0


async def test_implicit_caching_reads_back_the_longest_prefix_seen() -> None:
    api = FakeGeminiAPI(min_cache_tokens=64)
    long = "The lighthouse keeper's log. " * 40
    async with client(api) as sdk:
        first = await sdk.aio.models.generate_content(model=MODEL, contents=[long])
        again = await sdk.aio.models.generate_content(model=MODEL, contents=[long, "And more?"])
        other = await sdk.aio.models.generate_content(
            model="gemini-3-other", contents=[long, "And more?"]
        )
    assert first.usage_metadata and not first.usage_metadata.cached_content_token_count
    assert again.usage_metadata and again.usage_metadata.cached_content_token_count
    assert (
        first.usage_metadata.prompt_token_count == again.usage_metadata.cached_content_token_count
    )
    assert other.usage_metadata and not other.usage_metadata.cached_content_token_count
