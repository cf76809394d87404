"""OpenAI's Chat Completions API as vLLM, Ollama, llama.cpp, SGLang, OpenRouter and other
servers serve it, over httpx (``POST {base}/chat/completions``), natively and streamed.

One POST per call, never retried; ``Authorization: Bearer`` only when a key is configured (a
local server has none). The request is built by ``chat_completions_request.chat_body``. The
reply's one assistant message is its one output item (service/core/translate/chat_messages.py):
a whole reply's ``choices[0].message`` as the bytes the server sent; a stream's deltas joined
into the message the server would have sent whole (``role``, ``content``, ``tool_calls`` in
order of their index, then the thinking under the name the server streamed it by:
``reasoning_content`` or ``reasoning``). Two things are made so before it is kept: ``role``
first (how a Chat message is told from a Responses item), and an id on each tool call a server
left without one (``call_`` and 24 random hex digits, minted once and kept: stable, and never
colliding), since its ``tool`` message must name it. A stream's thinking is announced
(``ItemDone``, a part of the message still to come) as soon as its text or calls start.

What the server says maps as (CONTRACT.md, "Providers"): HTTP 429 -> RateLimited with a plain
Retry-After; a 400 saying the context is too long -> ContextLengthExceeded; any other 400 ->
ProviderRefused with the client's param; any other non-2xx, an ``error`` in a stream, or a
stream that ends before ``[DONE]`` -> UpstreamError; ``finish_reason`` ``stop`` /
``tool_calls`` completed, ``length`` incomplete, ``content_filter`` -> ContentFiltered. No
token counting (no Chat server has an endpoint for it) and no compaction.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from service.core import errors
from service.core.model import ReplyStatus
from service.core.translate.chat_messages import (
    START,
    THINKING_FIELDS,
    ChatMessage,
    reasoning_id,
)
from service.core.usage import Usage
from service.providers import base, wire
from service.providers.chat_completions_request import chat_body

# Chat's top-level fields in a 400, as the client's request names them.
CLIENT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "temperature": "temperature",
    "top_p": "top_p",
    "response_format": "text",
    "reasoning_effort": "reasoning.effort",
    "user": "user",
}
_COMPLETED = frozenset({"stop", "tool_calls", "function_call"})
# How servers say a prompt is too long: vLLM and OpenRouter ("maximum context length"), vLLM's
# newer "longer than the maximum model length", llama.cpp ("exceed_context_size_error",
# "exceeds the available context size"), OpenAI's code.
_TOO_LONG = re.compile(
    r"maximum context length|maximum model length|context_length_exceeded"
    r"|exceed_context_size|exceeds the available context size|context length exceeded",
    re.I,
)


@dataclass(frozen=True)
class ChatEndpoint:
    name: str  # the provider's name: "chat", or its name in PROVIDERS_FILE
    base_url: str  # e.g. http://localhost:8000/v1 (vLLM), http://localhost:11434/v1 (Ollama)
    api_key: str | None = field(repr=False)  # None: no Authorization header
    model: str

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


# -- the answer --------------------------------------------------------------------------------


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None

    def value(self) -> Usage:
        """As OpenAI counts it: prompt tokens are every input token, cached or not; completion
        tokens every output token, thinking included."""
        tokens_in, tokens_out = self.prompt_tokens or 0, self.completion_tokens or 0
        cached = (self.prompt_tokens_details or _PromptDetails()).cached_tokens or 0
        thought = (self.completion_tokens_details or _CompletionDetails()).reasoning_tokens or 0
        return Usage(tokens_in, cached, tokens_out, thought, tokens_in + tokens_out)


class _Choice(msgspec.Struct):
    message: msgspec.Raw
    finish_reason: str | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class _ErrorBody(msgspec.Struct):
    """``{"error": {...}}`` (OpenAI, vLLM, Ollama, llama.cpp, OpenRouter) or, from vLLM before
    0.10, the error's fields at the top with ``"object": "error"``."""

    error: _ErrorDetail | str | None = None
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None

    def detail(self) -> _ErrorDetail:
        if isinstance(self.error, _ErrorDetail):
            return self.error
        if isinstance(self.error, str):  # a bare message
            return _ErrorDetail(self.error)
        return _ErrorDetail(self.message, self.type, self.param, self.code)


def _error(status: int, detail: _ErrorDetail) -> errors.TurnstoreError:
    said = f"{detail.message} {detail.type or ''} {detail.code or ''}"
    if status == 429:
        return errors.RateLimited()
    if _TOO_LONG.search(said):
        return errors.ContextLengthExceeded()
    if status == 400:  # the request's fault: a /v1 client's own, passed on with its param
        param = CLIENT_PARAMS.get((detail.param or "").partition(".")[0])
        kind = detail.code if isinstance(detail.code, str) else None
        return errors.ProviderRefused(kind or "invalid_request_error", param)
    return errors.UpstreamError(f"The provider answered HTTP {status}." if status else None)


def _status_error(status: int, body: bytes) -> errors.TurnstoreError:
    try:
        detail = msgspec.json.decode(body, type=_ErrorBody).detail()
    except msgspec.DecodeError:
        detail = _ErrorDetail()
    return _error(status, detail)


def minted_call_id() -> str:
    """An id for a tool call its server sent without one: random, so it never collides; kept
    with the message, so it is stable."""
    return f"call_{os.urandom(12).hex()}"


def kept(raw: bytes) -> msgspec.Raw:
    """A whole reply's message as it is kept: the server's bytes, unless they lack ``role``
    first or an id on a tool call (then rebuilt so, in the server's order otherwise)."""
    if raw.startswith(START):
        read = msgspec.json.decode(raw, type=ChatMessage)
        if all(call.id for call in read.tool_calls or ()):
            return msgspec.Raw(raw)
    decoded: dict[str, Any] = msgspec.json.decode(raw)
    if not isinstance(decoded, dict):
        raise errors.UpstreamError("The provider's message was not an object.")
    for call in decoded.get("tool_calls") or ():
        if isinstance(call, dict) and not call.get("id"):
            call["id"] = minted_call_id()
    rest = {k: v for k, v in decoded.items() if k != "role"}
    return msgspec.Raw(msgspec.json.encode({"role": "assistant", **rest}))


def _reply(raw: msgspec.Raw, finish_reason: str | None, usage: _Usage | None) -> base.Reply:
    status: ReplyStatus
    reason = None
    if finish_reason in _COMPLETED:
        status = "completed"
    elif finish_reason == "length":
        status, reason = "incomplete", "max_output_tokens"
    elif finish_reason == "content_filter":
        raise errors.ContentFiltered()
    else:
        raise errors.UpstreamError("The provider's message ended for no reason it names.")
    text = msgspec.json.decode(raw, type=ChatMessage).text
    return base.Reply(text, status, reason, [raw], usage.value() if usage else None)


# -- a stream ----------------------------------------------------------------------------------


class _DeltaFunction(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _DeltaCall(msgspec.Struct):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: _DeltaFunction | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[_DeltaCall] | None = None


class _StreamChoice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_StreamChoice] = []
    usage: _Usage | None = None
    error: _ErrorDetail | None = None
    object: str | None = None
    message: str = ""


class _Call:
    def __init__(self) -> None:
        self.id: str | None = None
        self.name: list[str] = []
        self.arguments: list[str] = []

    def add(self, delta: _DeltaCall) -> None:
        self.id = self.id or delta.id or None
        if delta.function is not None:
            self.name.append(delta.function.name or "")
            self.arguments.append(delta.function.arguments or "")

    def done(self) -> dict[str, Any]:
        function = {"name": "".join(self.name), "arguments": "".join(self.arguments)}
        return {"id": self.id or minted_call_id(), "type": "function", "function": function}


class _EventStream:
    """Turns a streamed body, chunk by chunk, into provider events (its server-sent events:
    wire.py): text deltas as they come, the thinking announced once it ends, the reply (the
    message joined) at ``[DONE]``."""

    def __init__(self) -> None:
        self.finished = False
        self.text_bytes = 0  # of what was streamed so far (text and thinking)
        self._content: list[str] = []
        self._refusal: list[str] = []
        # The thinking under each name the server streams it by (some send both, alike).
        self._thinking: dict[str, list[str]] = {}
        self._announced = False
        self._calls: list[_Call] = []  # in the order they began
        self._open: dict[int, int] = {}  # a call's index -> its place in _calls
        self._finish_reason: str | None = None
        self._usage: _Usage | None = None
        self._events = wire.ServerSentEvents()

    def feed(self, chunk: bytes) -> Iterator[base.ProviderEvent]:
        for data in self._events.feed(chunk):
            yield from self._chunk(data)
            if self.finished:
                return

    def _chunk(self, data: bytes) -> Iterator[base.ProviderEvent]:
        if data.strip() == b"[DONE]":
            if self._finish_reason is None:
                raise errors.UpstreamError("The provider's stream ended without a finish reason.")
            yield from self._announce()
            self.finished = True
            yield _reply(self.message(), self._finish_reason, self._usage)
            return
        chunk = msgspec.json.decode(data, type=_Chunk)
        if chunk.error is not None or chunk.object == "error":
            raise _error(0, chunk.error or _ErrorDetail(chunk.message))
        if chunk.usage is not None:
            self._usage = chunk.usage
        for choice in chunk.choices[:1]:  # n is always 1: the first choice is the reply
            yield from self._delta(choice.delta)
            self._finish_reason = choice.finish_reason or self._finish_reason

    def _delta(self, delta: _Delta) -> Iterator[base.ProviderEvent]:
        pieces = {name: getattr(delta, name) for name in THINKING_FIELDS if getattr(delta, name)}
        for name, piece in pieces.items():
            self._thinking.setdefault(name, []).append(piece)
        if pieces:  # the same thinking under two names counts once
            self.text_bytes += max(len(piece.encode()) for piece in pieces.values())
        if delta.content or delta.tool_calls or delta.refusal:
            yield from self._announce()
        for call in delta.tool_calls or ():
            self._call(call).add(call)
        if delta.refusal:
            self._refusal.append(delta.refusal)
        if delta.content:
            self._content.append(delta.content)
            self.text_bytes += len(delta.content.encode())
            yield base.TextDelta(delta.content)

    def _call(self, delta: _DeltaCall) -> _Call:
        """The call a delta continues: the one open at its index, unless it names another id
        (Ollama streams each of several calls whole, every one at index 0)."""
        at = self._open.get(delta.index)
        if at is None or (delta.id and self._calls[at].id not in (None, delta.id)):
            at = self._open[delta.index] = len(self._calls)
            self._calls.append(_Call())
        return self._calls[at]

    def _announce(self) -> Iterator[base.ProviderEvent]:
        """The thinking, once it ends: shown before the text, as the part of the message it is."""
        if self._thinking and not self._announced:
            self._announced = True
            thinking = "".join(next(iter(self._thinking.values())))
            summary = [{"type": "summary_text", "text": thinking}]
            item = {"type": "reasoning", "id": reasoning_id(thinking), "summary": summary}
            yield base.ItemDone(msgspec.Raw(msgspec.json.encode(item)), partial=True)

    def message(self) -> msgspec.Raw:
        """The message the server would have sent whole."""
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._refusal:
            out["refusal"] = "".join(self._refusal)
        if self._calls:
            out["tool_calls"] = [call.done() for call in self._calls]
        for name, pieces in self._thinking.items():
            out[name] = "".join(pieces)
        return msgspec.Raw(msgspec.json.encode(out))


class ChatProvider(wire.Translating):
    def __init__(
        self,
        endpoint: ChatEndpoint,
        limits: wire.WireLimits,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._url = endpoint.url
        self.origin = wire.replay_origin(
            endpoint.name, self._url, endpoint.model, "chat", endpoint.api_key
        )
        headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._wire = wire.Wire(headers, _status_error, ("x-request-id",), limits, transport)

    async def respond(
        self, request: base.ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        model = request.model or self.endpoint.model
        content = chat_body(request, model, stream=stream)
        with wire.translated():
            async with self._wire.post(self._url, content) as response:
                # Leaving it (also by aclose() of this generator) closes the stream.
                if not stream:
                    body = msgspec.json.decode(await self._wire.read(response), type=_Completion)
                    if not body.choices:
                        raise errors.UpstreamError("The provider's reply held no message.")
                    choice = body.choices[0]
                    message = kept(bytes(choice.message))
                    self._wire.check_reply(len(message), 0)
                    yield _reply(message, choice.finish_reason, body.usage)
                    return
                events = _EventStream()
                async for chunk in self._wire.chunks(response):
                    for event in events.feed(chunk):
                        if isinstance(event, base.Reply):
                            self._wire.check_reply(len(event.output_items[0]), 0)
                        yield event
                    self._wire.check_reply(0, events.text_bytes)
                    if events.finished:
                        return
        raise errors.UpstreamError("The provider's stream ended before the message was complete.")

    async def count_tokens(self, request: base.ProviderRequest) -> int:
        raise errors.InvalidInput(
            "This model's provider (a Chat Completions server) cannot count tokens.",
            param="model",
        )
