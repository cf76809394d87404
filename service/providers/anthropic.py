"""Anthropic's Messages API over httpx (``POST /v1/messages``), natively and streamed.

One POST per call, never retried. The request is built by ``anthropic_request.messages_body``
(Anthropic's own blocks spliced byte for byte; a client's fields mapped or refused with their
param; prompt-cache breakpoints). With ``stream=True`` the body is read as server-sent events,
else as one JSON message; either way each content block becomes one output item, as the reply
sent whole carries it (a whole reply's blocks are kept as the bytes it sent; a stream's deltas
of one block are joined into it), and the reply may not grow past ``max_body_bytes`` nor the
wire past ``max_wire_bytes``.

What the provider says maps as (CONTRACT.md, "Providers"): HTTP 429 ``rate_limit_error`` and
529 ``overloaded_error`` -> RateLimited with a plain Retry-After; a 400 ``prompt is too long``
-> ContextLengthExceeded; a 400 on an invalid ``signature`` (or redacted ``data``) ->
InvalidEncryptedContent (the use case retries once without opaque items); any other 400 ->
ProviderRefused (a /v1 client's own error, the server's on /api/v1); any other non-2xx, a
stream ``error`` event or a stream cut short -> UpstreamError; ``stop_reason`` ``refusal`` ->
ContentFiltered; httpx's errors as every adapter maps them (service/providers/wire.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import msgspec

from service.core import errors
from service.core.model import ReplyStatus
from service.core.translate.anthropic_blocks import OPAQUE_BLOCKS
from service.core.usage import Usage
from service.providers import base, wire
from service.providers.anthropic_request import count_body, messages_body

log = logging.getLogger("turnstore.provider")

DEFAULT_BASE_URL = "https://api.anthropic.com"
VERSION = "2023-06-01"
# Anthropic's top-level fields in a 400's message, as the client's request names them.
CLIENT_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "system": "instructions",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "thinking": "reasoning",
    "temperature": "temperature",
    "top_p": "top_p",
    "output_config": "text",
    "metadata": "user",
}
_COMPLETED = frozenset({"end_turn", "tool_use", "stop_sequence", "pause_turn"})
_TRUNCATED = frozenset({"max_tokens", "model_context_window_exceeded"})


class AnthropicEndpoint(wire.HostedEndpoint):
    @property
    def url(self) -> str:
        return self.root(DEFAULT_BASE_URL) + "/v1/messages"


# -- the answer --------------------------------------------------------------------------------


class _Usage(msgspec.Struct):
    input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    output_tokens: int | None = None

    def updated(self, later: _Usage) -> _Usage:
        """A stream's cumulative usage: the later counts where it reports them."""
        return _Usage(
            _later(self.input_tokens, later.input_tokens),
            _later(self.cache_creation_input_tokens, later.cache_creation_input_tokens),
            _later(self.cache_read_input_tokens, later.cache_read_input_tokens),
            _later(self.output_tokens, later.output_tokens),
        )

    def value(self) -> Usage:
        """As OpenAI counts it: every input token, cache reads and writes included."""
        read = self.cache_read_input_tokens or 0
        written = self.cache_creation_input_tokens or 0
        total_in = (self.input_tokens or 0) + read + written
        out = self.output_tokens or 0
        return Usage(total_in, read, out, 0, total_in + out, written)


def _later(first: int | None, later: int | None) -> int | None:
    return first if later is None else later


class _Message(msgspec.Struct):
    content: list[msgspec.Raw] = []
    stop_reason: str | None = None
    usage: _Usage | None = None


class _Counted(msgspec.Struct):
    input_tokens: int


class _TextBlock(msgspec.Struct):
    type: str
    text: str = ""


class _ErrorDetail(msgspec.Struct):
    type: str = ""
    message: str = ""


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


# Stream events: the type first, then only the events used, each with only the fields used.
class _Event(msgspec.Struct):
    type: str


class _Start(msgspec.Struct):
    message: _Message


class _BlockStart(msgspec.Struct):
    index: int
    content_block: dict[str, Any]  # in the order the API sends its fields


class _Delta(msgspec.Struct):
    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    partial_json: str | None = None
    citation: Any = None


class _BlockDelta(msgspec.Struct):
    index: int
    delta: _Delta


class _BlockStop(msgspec.Struct):
    index: int


class _StopDelta(msgspec.Struct):
    stop_reason: str | None = None


class _MessageDelta(msgspec.Struct):
    delta: _StopDelta
    usage: _Usage | None = None


class _StreamError(msgspec.Struct):
    error: _ErrorDetail


def _error(status: int, error: _ErrorDetail | None) -> errors.TurnstoreError:
    """What an HTTP status and Anthropic's error body (or a stream's error event) mean here."""
    kind, message = (error.type, error.message) if error else ("", "")
    if status in (429, 529) or kind in ("rate_limit_error", "overloaded_error"):
        return errors.RateLimited()
    if status == 400 or kind == "invalid_request_error":
        if message.startswith("prompt is too long"):
            return errors.ContextLengthExceeded()
        if "Invalid `signature`" in message or "Invalid `data` in `redacted_thinking`" in message:
            return errors.InvalidEncryptedContent()
        if status == 400:  # the request's fault: a /v1 client's own, passed on with its param
            param = message.partition(":")[0].partition(".")[0]
            return errors.ProviderRefused(kind or "invalid_request_error", CLIENT_PARAMS.get(param))
    return errors.UpstreamError(f"The provider answered HTTP {status}." if status else None)


def _status_error(status: int, body: bytes) -> errors.TurnstoreError:
    try:
        detail = msgspec.json.decode(body, type=_ErrorBody).error
    except msgspec.DecodeError:
        detail = None
    return _error(status, detail)


def _reply(blocks: list[msgspec.Raw], stop_reason: str | None, usage: _Usage | None) -> base.Reply:
    status: ReplyStatus
    reason = None
    if stop_reason in _COMPLETED:
        status = "completed"
    elif stop_reason in _TRUNCATED:
        status, reason = "incomplete", "max_output_tokens"
    elif stop_reason == "refusal":
        raise errors.ContentFiltered()
    else:
        raise errors.UpstreamError("The provider's message ended for no reason it names.")
    texts = [msgspec.json.decode(block, type=_TextBlock) for block in blocks]
    text = "".join(block.text for block in texts if block.type == "text")
    return base.Reply(text, status, reason, list(blocks), usage.value() if usage else None)


class _Block:
    """One streamed content block as it grows: its start's fields, then its deltas joined."""

    def __init__(self, start: dict[str, Any]) -> None:
        self.fields = start
        self.kind = str(start.get("type"))
        self.parts: dict[str, list[str]] = {}

    def add(self, delta: _Delta) -> str | None:
        """Take one delta; the text it adds to a text block, if it is one."""
        kinds = {
            "text_delta": ("text", delta.text),
            "thinking_delta": ("thinking", delta.thinking),
            "signature_delta": ("signature", delta.signature),
            "input_json_delta": ("input", delta.partial_json),
        }
        if delta.type == "citations_delta":
            self.fields["citations"] = [*(self.fields.get("citations") or []), delta.citation]
            return None
        name, value = kinds.get(delta.type, ("", None))
        if value is None:  # an unknown delta would change the block in ways not kept
            raise errors.UpstreamError("The provider's stream held a delta of an unknown kind.")
        self.parts.setdefault(name, []).append(value)
        return value if name == "text" else None

    def done(self) -> msgspec.Raw:
        block = dict(self.fields)
        for name, parts in self.parts.items():
            if name == "input":
                joined = "".join(parts)
                block["input"] = msgspec.json.decode(joined) if joined else block.get("input", {})
            else:
                block[name] = str(block.get(name) or "") + "".join(parts)
        return msgspec.Raw(msgspec.json.encode(block))


class _EventStream:
    """Turns a streamed body, chunk by chunk, into provider events (its server-sent events:
    wire.py). Each block is built from its ``content_block_start`` and deltas, and becomes an
    output item at its ``content_block_stop``; the reply comes with ``message_stop``."""

    def __init__(self) -> None:
        self.finished = False
        self.items: dict[int, msgspec.Raw] = {}  # the finished blocks, by index
        self.item_bytes = 0  # of the finished blocks
        self.text_bytes = 0  # of the text deltas so far
        self._open: dict[int, _Block] = {}
        self._stop_reason: str | None = None
        self._usage: _Usage | None = None
        self._events = wire.ServerSentEvents()

    def feed(self, chunk: bytes) -> Iterator[base.ProviderEvent]:
        return self._events.events(chunk, self._event, lambda: self.finished)

    def _event(self, data: bytes) -> base.ProviderEvent | None:
        kind = msgspec.json.decode(data, type=_Event).type
        if kind == "message_start":
            self._usage = msgspec.json.decode(data, type=_Start).message.usage
        elif kind == "content_block_start":
            start = msgspec.json.decode(data, type=_BlockStart)
            if start.index in self._open or start.index in self.items:
                raise errors.UpstreamError("The provider's stream started a block twice.")
            self._open[start.index] = _Block(start.content_block)
        elif kind == "content_block_delta":
            delta = msgspec.json.decode(data, type=_BlockDelta)
            text = self._block(delta.index).add(delta.delta)
            if text is not None:
                self.text_bytes += len(text.encode())
                return base.TextDelta(text) if text else None
        elif kind == "content_block_stop":
            index = msgspec.json.decode(data, type=_BlockStop).index
            block = self._block(index)
            del self._open[index]
            self.items[index] = item = block.done()
            self.item_bytes += len(item)
            if block.kind in OPAQUE_BLOCKS:
                return base.ItemDone(item)  # announced before the text that follows it
        elif kind == "message_delta":
            ending = msgspec.json.decode(data, type=_MessageDelta)
            self._stop_reason = ending.delta.stop_reason or self._stop_reason
            if ending.usage is not None:
                self._usage = self._usage.updated(ending.usage) if self._usage else ending.usage
        elif kind == "message_stop":
            if self._open:
                raise errors.UpstreamError(
                    "The provider's stream ended a message with a block open."
                )
            self.finished = True
            blocks = [self.items[i] for i in sorted(self.items)]
            return _reply(blocks, self._stop_reason, self._usage)
        elif kind == "error":
            raise _error(0, msgspec.json.decode(data, type=_StreamError).error)
        return None  # ping, and event types the API may add

    def _block(self, index: int) -> _Block:
        if index not in self._open:
            raise errors.UpstreamError(
                "The provider's stream continued a block it had not started."
            )
        return self._open[index]


class AnthropicProvider(wire.Translating):
    def __init__(
        self,
        endpoint: AnthropicEndpoint,
        limits: wire.WireLimits,
        *,
        max_tokens: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._url = endpoint.url
        # Where this provider's thinking can be replayed.
        self.origin = wire.replay_origin(
            endpoint.name, self._url, endpoint.model, "anthropic", endpoint.api_key
        )
        self._max_tokens = max_tokens  # when the client does not say (the API requires one)
        self._wire = wire.Wire(
            {"x-api-key": endpoint.api_key, "anthropic-version": VERSION},
            _status_error,
            ("request-id",),
            limits,
            transport,
        )

    async def respond(
        self, request: base.ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        model = request.model or self.endpoint.model
        content = messages_body(request, model, max_tokens=self._max_tokens, stream=stream)
        with wire.translated():
            async with self._wire.post(self._url, content) as response:
                # Leaving it (also by aclose() of this generator) closes the stream.
                if not stream:
                    body = msgspec.json.decode(await self._wire.read(response), type=_Message)
                    self._wire.check_reply(sum(map(len, body.content)), 0)
                    yield _reply(body.content, body.stop_reason, body.usage)
                    return
                events = _EventStream()
                async for chunk in self._wire.chunks(response):
                    for event in events.feed(chunk):
                        yield event
                    self._wire.check_reply(events.item_bytes, events.text_bytes)
                    if events.finished:
                        return
        raise errors.UpstreamError("The provider's stream ended before the message was complete.")

    async def count_tokens(self, request: base.ProviderRequest) -> int:
        """``POST {base}/v1/messages/count_tokens``: the provider's count of the request."""
        model = request.model or self.endpoint.model
        content = count_body(request, model, max_tokens=self._max_tokens)
        with wire.translated():
            async with self._wire.post(f"{self._url}/count_tokens", content) as response:
                body = await self._wire.read(response)
                return msgspec.json.decode(body, type=_Counted).input_tokens
