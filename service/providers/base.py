"""The provider port.

A provider turns a request (replay items + the new user input item) into a stream of
events: zero or more ``ItemDone`` (an output item finished before the text: reasoning) and
``TextDelta``, and exactly one final ``Reply`` (the last event, with every output item). With
``stream=False`` an adapter may make a non-streaming call and yield the ``Reply`` alone.
Failures are raised as domain errors (RateLimited, ContextLengthExceeded, ContentFiltered,
UpstreamError, UpstreamTimeout); an adapter never retries on its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import msgspec

from service.core.errors import UpstreamError
from service.core.model import Origin, ReplyStatus
from service.core.translate import to_items
from service.core.usage import Usage


@dataclass(frozen=True)
class ProviderRequest:
    input_items: list[msgspec.Raw]
    instructions: str | None = None
    tools: msgspec.Raw | None = None  # the function tools advertised, already encoded
    model: str | None = None  # None: the provider's configured model
    # A client's own top-level fields (temperature, text, tool_choice...: on /v1, every field
    # turnstore does not interpret), sent as they came.
    fields: Mapping[str, msgspec.Raw] = field(default_factory=dict)
    include: tuple[str, ...] = ()  # what the client asked to include besides encrypted reasoning
    # Its first so many input items are known to be Responses items (its window's, core/
    # window.py ``Window.plain``): translating the request does not look at them again.
    plain: int = 0


@dataclass(frozen=True)
class TextDelta:
    text: str
    item_id: str | None = None  # the output message it belongs to, when the provider says


@dataclass(frozen=True)
class ItemDone:
    """An output item finished before the text (reasoning, a compaction item), as the
    provider sent it (the Reply holds it too, or the turn's compacted context): a stream
    announces it before the message that follows it."""

    item: msgspec.Raw
    # A part of the output item still to come, shown as an item of its own (a Chat message's
    # thinking, kept inside its message): it takes no place of its own in the turn.
    partial: bool = False


@dataclass(frozen=True)
class Reply:
    """The provider's final answer: its text and its output items, verbatim."""

    text: str
    status: ReplyStatus
    incomplete_reason: str | None
    output_items: list[msgspec.Raw]
    usage: Usage | None = None  # as the provider reported it


ProviderEvent = ItemDone | TextDelta | Reply


@dataclass(frozen=True)
class Compacted:
    """What the provider's compaction made of a context: the user messages it kept, then one
    opaque ``compaction`` item (replayed byte for byte, like sealed reasoning)."""

    items: list[msgspec.Raw]
    usage: Usage | None = None


ENCRYPTED_REASONING = "reasoning.encrypted_content"


def encode_request(model: str, request: ProviderRequest, *, stream: bool) -> bytes:
    """A Responses API request: always ``store: false`` and with encrypted reasoning included;
    ``input`` holds raw items, which msgspec splices as they are, and so are a client's own
    fields."""
    include = [ENCRYPTED_REASONING, *(i for i in request.include if i != ENCRYPTED_REASONING)]
    return _encode(model, request, {"store": False, "include": include, "stream": stream})


def encode_compaction(model: str, request: ProviderRequest) -> bytes:
    """A ``POST /responses/compact`` request: the fields that endpoint takes (no tools, no
    client fields)."""
    return _encode(model, replace(request, tools=None, fields={}), {})


def encode_count(model: str, request: ProviderRequest) -> bytes:
    """A ``POST /responses/input_tokens`` request: what a create would send, less what only a
    create takes (``store``, ``stream``, ``include``)."""
    return _encode(model, request, {})


def _encode(model: str, request: ProviderRequest, create: dict[str, object]) -> bytes:
    """The one body every endpoint's request is cut from: model and input, what only its
    endpoint takes (``create``), then instructions, tools and a client's own fields."""
    # Turns another provider answered carry its items: the Responses API gets them translated.
    body: dict[str, object] = {
        "model": request.model or model,
        "input": to_items(request.input_items, request.plain),
    }
    body |= create
    if request.instructions is not None:
        body["instructions"] = request.instructions
    if request.tools is not None:
        body["tools"] = request.tools
    body.update(request.fields)
    return msgspec.json.encode(body)


def request_overhead(model: str, request: ProviderRequest, *, stream: bool) -> int:
    """Bytes of ``request`` serialised with an empty ``input`` list (every provider sends the
    Responses API's shape; the fake is sized like it, so budgets behave as in production)."""
    empty = replace(request, input_items=[]) if request.input_items else request
    return len(encode_request(model, empty, stream=stream))


class Provider(Protocol):
    origin: Origin  # its configured model's: recorded with each turn whose items it produced

    def origin_for(self, model: str | None) -> Origin:
        """The origin of what it answers for ``model`` (None: its configured model); one
        provider's origin differs by its model alone (an adapter that subclasses the port
        inherits this)."""
        return self.origin.with_model(model)

    def compacts(self, model: str | None) -> bool:
        """Whether it compacts for ``model`` (``compact``; else CompactionUnsupported)."""
        return True

    def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        """Yield the reply's events; closing the iterator early cancels the upstream call."""

    async def compact(self, request: ProviderRequest) -> Compacted:
        """The provider's compaction of ``request.input_items`` (its model and instructions
        too; no other field). Raises the same domain errors as ``respond``."""

    async def count_tokens(self, request: ProviderRequest) -> int:
        """How many input tokens ``request`` would cost, counted by the provider (its own
        counting endpoint). Raises the same domain errors as ``respond``."""

    async def close(self) -> None: ...


async def replied(
    events: AsyncGenerator[ProviderEvent, None],
) -> AsyncGenerator[ProviderEvent, None]:
    """A provider's events, checked: its text deltas, then its Reply (UpstreamError when it
    ends without one: the one place that rule lives). The Reply is passed on once the adapter
    has ended: its last checks have run, and its answer is done with (wire.py reads the
    stream's rest, so that the connection serves the next request instead of being closed);
    what it would yield after the Reply is not passed on. Closed early, this leaves the adapter
    to asyncio's finalizer, which closes it (the upstream request with it) in a task of its
    own: closed here, in a cancelled turn's task, a second cancellation (a cancel seen twice)
    could cut that close short and leave the upstream request open."""
    reply: Reply | None = None
    async for event in events:
        if isinstance(event, Reply):
            reply = reply or event
        elif reply is None:
            yield event
    if reply is None:
        raise UpstreamError("The provider ended without a reply.")
    yield reply
