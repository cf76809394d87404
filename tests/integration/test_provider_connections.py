"""A provider's connection serves turn after turn (service/providers/wire.py, ``Wire._rest``,
and base.replied): every adapter reads a streamed answer to its end after its final event,
so httpx keeps the connection; closed unread, each streamed turn paid a new connection, which
to a real provider is a TCP and TLS handshake before the request can start. Each fake is
served over real HTTP (tests/support/over_http.py), so the connections counted are real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import pytest

from service.core.items import user_input_item
from service.providers import wire
from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.base import Provider, ProviderRequest, Reply, TextDelta, replied
from service.providers.chat_completions import ChatEndpoint, ChatProvider
from service.providers.gemini import GeminiEndpoint, GeminiProvider
from service.providers.openai_responses import Endpoint, ResponsesProvider
from service.providers.wire import WireLimits
from tests.support import fake_anthropic, fake_chat, fake_gemini
from tests.support.events import event_names
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, Target, serve
from tests.support.over_http import OverHttp

LIMITS = WireLimits(connect_timeout_s=1.0, read_timeout_s=5.0, max_body_bytes=1 << 20)


def _responses(url: str) -> Provider:
    return ResponsesProvider(Endpoint.openai(f"{url}/v1", "sk-test", "gpt-test"), LIMITS)


def _anthropic(url: str) -> Provider:
    endpoint = AnthropicEndpoint("anthropic", url, fake_anthropic.API_KEY, "claude-test")
    return AnthropicProvider(endpoint, LIMITS, max_tokens=1024)


def _gemini(url: str) -> Provider:
    endpoint = GeminiEndpoint("google", url, fake_gemini.API_KEY, "gemini-3-test")
    return GeminiProvider(endpoint, LIMITS)


def _chat(url: str) -> Provider:
    endpoint = ChatEndpoint("vllm", f"{url}/v1", fake_chat.API_KEY, "qwen-test")
    return ChatProvider(endpoint, LIMITS)


ADAPTERS: dict[str, tuple[Callable[[], Any], Callable[[str], Provider]]] = {
    "responses": (FakeResponsesAPI, _responses),
    "anthropic": (fake_anthropic.FakeMessagesAPI, _anthropic),
    "gemini": (fake_gemini.FakeGeminiAPI, _gemini),
    "chat": (fake_chat.FakeChatServer, _chat),
}


@asynccontextmanager
async def served(name: str) -> AsyncIterator[tuple[OverHttp, Provider]]:
    fake, adapter = ADAPTERS[name]
    app = OverHttp(fake())
    async with serve(app) as url:
        provider = adapter(url)
        try:
            yield app, provider
        finally:
            await provider.close()


async def reply(provider: Provider, n: int, *, stream: bool) -> Reply:
    request = ProviderRequest([user_input_item(f"question {n}")])
    events = [event async for event in replied(provider.respond(request, stream=stream))]
    assert isinstance(events[-1], Reply), events
    return events[-1]


@pytest.mark.parametrize("name", list(ADAPTERS))
async def test_streamed_and_whole_replies_take_turns_on_one_connection(name: str) -> None:
    async with served(name) as (app, provider):
        for n in range(3):
            await reply(provider, n, stream=True)
        await reply(provider, 3, stream=False)
        assert len(app.arrivals) == 4
        assert len(app.connections) == 1, app.connections


async def test_a_stream_left_before_its_end_closes_its_connection() -> None:
    """A turn cancelled (or whose client went away) closes the upstream request at once: its
    connection is not read on, and the next request opens another. (The rest of this stream
    takes 0.04 s, well within wire.REST_S: read on, the connection would be kept.)"""
    async with served("responses") as (app, provider):
        app.fake.then(Script(text="a long answer", deltas=8, drip_s=0.005))
        request = ProviderRequest([user_input_item("tell me")])
        async with aclosing(replied(provider.respond(request, stream=True))) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    break
        await reply(provider, 1, stream=True)
        assert len(app.connections) == 2, app.connections


async def test_a_stream_kept_open_after_its_final_event_is_not_waited_for() -> None:
    """A server that keeps a finished stream open: the reply is whole at its final event, and
    the connection is given up after ``wire.REST_S`` instead of holding the turn until the
    read timeout (5 s here)."""
    async with served("responses") as (app, provider):
        app.held = asyncio.Event()
        async with asyncio.timeout(wire.REST_S + 2):
            answered = await reply(provider, 0, stream=True)
        assert answered.status == "completed"
        app.held.set()
        await reply(provider, 1, stream=True)
        assert len(app.connections) == 2, app.connections


async def test_every_kind_of_turn_keeps_the_providers_connection(target: Target) -> None:
    """Through the app: streamed and whole turns on both surfaces, stored or not (a /v1 stream
    with store: false ends its response at the reply, before the provider's answer has ended),
    all on one connection to the provider."""
    fake = OverHttp(FakeResponsesAPI())
    async with serve(fake) as upstream:
        provider = _responses(upstream)
        async with serve(target.app(provider)) as url, httpx.AsyncClient(base_url=url) as client:
            made = await client.post(CHAT, json={"message": "first"})
            cid = made.raise_for_status().json()["conversation_id"]
            v1 = {"model": "gpt-test", "input": "again", "stream": True}
            for _ in range(2):
                names = await event_names(
                    client,
                    "POST",
                    "/api/v1/chat/stream",
                    json={"message": "again", "conversation_id": cid},
                )
                assert names[-1] == "message.done", names
                stored = await event_names(client, "POST", "/v1/responses", json=v1)
                assert stored[-1] == "response.completed", stored
                relayed = await event_names(
                    client, "POST", "/v1/responses", json={**v1, "store": False}
                )
                assert relayed[-1] == "response.completed", relayed
                whole = await client.post(
                    "/v1/responses", json={**v1, "stream": False, "store": False}
                )
                assert whole.status_code == 200, whole.text
        await provider.close()
    assert len(fake.arrivals) == 9
    assert len(fake.connections) == 1, fake.connections
