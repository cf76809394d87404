"""The provider port.

A provider turns a request (replay items + the new user input item) into a stream of
events: zero or more ``TextDelta`` and exactly one final ``Reply`` (the last event). With
``stream=False`` an adapter may make a non-streaming call and yield the ``Reply`` alone.
Failures are raised as domain errors (RateLimited, ContextLengthExceeded, ContentFiltered,
UpstreamError, UpstreamTimeout); an adapter never retries on its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import msgspec

from service.core.errors import UpstreamError
from service.core.model import Origin, ReplyStatus


@dataclass(frozen=True)
class ProviderRequest:
    input_items: list[msgspec.Raw]
    instructions: str | None = None
    tools: msgspec.Raw | None = None  # the function tools advertised, already encoded


@dataclass(frozen=True)
class TextDelta:
    text: str
    item_id: str | None = None  # the output message it belongs to, when the provider says


@dataclass(frozen=True)
class Reply:
    """The provider's final answer: its text and its output items, verbatim."""

    text: str
    status: ReplyStatus
    incomplete_reason: str | None
    output_items: list[msgspec.Raw]


ProviderEvent = TextDelta | Reply


class RequestBody(msgspec.Struct, omit_defaults=True):
    """A Responses API request. ``input`` holds raw items: msgspec splices them as they are."""

    model: str
    input: list[msgspec.Raw]
    store: bool
    include: list[str]
    stream: bool
    instructions: str | None = None
    tools: msgspec.Raw | None = None


def encode_request(model: str, request: ProviderRequest, *, stream: bool) -> bytes:
    body = RequestBody(
        model=model,
        input=request.input_items,
        store=False,
        include=["reasoning.encrypted_content"],
        stream=stream,
        instructions=request.instructions,
        tools=request.tools,
    )
    return msgspec.json.encode(body)


def request_overhead(
    model: str, instructions: str | None, tools: msgspec.Raw | None, *, stream: bool
) -> int:
    """Bytes of a serialised request with an empty ``input`` list (every provider sends the
    Responses API's shape; the fake is sized like it, so budgets behave as in production)."""
    return len(encode_request(model, ProviderRequest([], instructions, tools), stream=stream))


class Provider(Protocol):
    origin: Origin  # recorded with each turn whose replay items this provider produced

    def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        """Yield the reply's events; closing the iterator early cancels the upstream call."""

    async def close(self) -> None: ...


async def replied(events: AsyncIterator[ProviderEvent]) -> AsyncGenerator[ProviderEvent, None]:
    """A provider's events, checked: its text deltas, then its Reply (UpstreamError when it
    ends without one: the one place that rule lives)."""
    async for event in events:
        yield event
        if isinstance(event, Reply):
            return
    raise UpstreamError("The provider ended without a reply.")
