"""The Gemini API over httpx: ``POST {base}/v1beta/models/{model}:generateContent``, and
``:streamGenerateContent?alt=sse`` streamed, with ``x-goog-api-key``.

One POST per call, never retried. The request is built by ``gemini_request.generate_body``
(Gemini's own parts spliced byte for byte; a client's fields mapped or refused with their
param). Each part of the model's ``Content`` becomes one output item, as the reply sent whole
carries it: a whole reply's parts are kept as the bytes it sent; a stream has no part index,
so its chunks' parts are joined as the whole reply has them: a chunk's text continues the
text part before it when both are thought or both are not, and a chunk that brings only a
signature (an empty text, as Gemini 3 ends a streamed text) joins the text part before it,
unless that one is signed already, and ends it; every other part (a ``functionCall``) is
whole in its chunk. (Two unsigned texts of one kind in a row are one part, as Gemini sends
them whole.) A call Gemini gave no id gets one minted (core/translate/gemini_parts.py
``minted``). The reply may not grow past ``max_body_bytes`` nor the wire past ``max_wire_bytes``.

What the provider says maps as (CONTRACT.md, "Providers"): ``finishReason`` ``STOP``
completed, ``MAX_TOKENS`` incomplete (``max_output_tokens``), ``SAFETY`` / ``RECITATION`` /
``BLOCKLIST`` / ``PROHIBITED_CONTENT`` / ``SPII`` (and their image kinds) or a
``promptFeedback.blockReason`` ContentFiltered, anything else UpstreamError; HTTP 429 or
``RESOURCE_EXHAUSTED`` -> RateLimited with the Retry-After it gives (its header, or the
``RetryInfo`` delay); a 400 on the input token count -> ContextLengthExceeded; a 400 on a
thought signature (missing or corrupted) -> InvalidEncryptedContent (the use case retries
once without opaque parts); any other 400 -> ProviderRefused; 504 or ``DEADLINE_EXCEEDED``
-> UpstreamTimeout; any other non-2xx, an ``error`` in the stream or a stream cut short ->
UpstreamError; httpx's errors as every adapter maps them (service/providers/wire.py). Usage
as OpenAI counts it: ``promptTokenCount`` in, ``cachedContentTokenCount`` cached,
``candidatesTokenCount`` plus ``thoughtsTokenCount`` out (the thoughts also as reasoning).
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import msgspec

from service.core import errors
from service.core.model import ReplyStatus
from service.core.translate.gemini_parts import GEMINI, minted
from service.core.usage import Usage
from service.providers import base, wire
from service.providers.gemini_request import count_body, generate_body

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"
FILTERED = frozenset(
    {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII"}
    | {"IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION"}
)
# Gemini's request fields, as a 400's message names them, and the client's params they are.
CLIENT_PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "topP": "top_p",
    "max_output_tokens": "max_output_tokens",
    "maxOutputTokens": "max_output_tokens",
    "response_json_schema": "text",
    "responseJsonSchema": "text",
    "response_schema": "text",
    "thinking_config": "reasoning",
    "thinkingConfig": "reasoning",
    "thinking_level": "reasoning",
    "tool_config": "tool_choice",
    "toolConfig": "tool_choice",
    "function_declarations": "tools",
    "tools": "tools",
    "system_instruction": "instructions",
    "systemInstruction": "instructions",
    "contents": "input",
}
_NAMED = re.compile(r"[A-Za-z_]+")
_DELAY = re.compile(r"\d{1,9}(?:\.\d{1,9})?s")
_TEXTUAL = frozenset({"text", "thought", "thoughtSignature"})  # a part a stream may split


class GeminiEndpoint(wire.HostedEndpoint):
    @property
    def base(self) -> str:
        return self.root(DEFAULT_BASE_URL) + "/v1beta/models/"

    def url(self, model: str, method: str) -> str:
        return f"{self.base}{model}:{method}"


# -- the answer --------------------------------------------------------------------------------


class _Usage(msgspec.Struct, rename="camel"):
    prompt_token_count: int = 0
    cached_content_token_count: int = 0
    candidates_token_count: int = 0
    thoughts_token_count: int = 0

    def value(self) -> Usage:
        """As OpenAI counts it: every input token (cached too), every output token."""
        out = self.candidates_token_count + self.thoughts_token_count
        total = self.prompt_token_count + out
        read, thoughts = self.cached_content_token_count, self.thoughts_token_count
        return Usage(self.prompt_token_count, read, out, thoughts, total, 0)


class _Content(msgspec.Struct):
    parts: list[msgspec.Raw] = []


class _Candidate(msgspec.Struct, rename="camel"):
    content: _Content | None = None
    finish_reason: str | None = None


class _Feedback(msgspec.Struct, rename="camel"):
    block_reason: str | None = None


class _ErrorDetail(msgspec.Struct):
    code: int = 0
    message: str = ""
    status: str = ""
    details: list[Any] = []


class _Response(msgspec.Struct, rename="camel"):
    candidates: list[_Candidate] = []
    prompt_feedback: _Feedback | None = None
    usage_metadata: _Usage | None = None
    error: _ErrorDetail | None = None  # a stream's error, in place of a chunk


class _Counted(msgspec.Struct, rename="camel"):
    total_tokens: int


class _Text(msgspec.Struct):
    text: str | None = None
    thought: bool = False


def _error(status: int, error: _ErrorDetail | None) -> errors.TurnstoreError:
    """What an HTTP status and Google's error body (or a stream's error) mean here."""
    kind, message = (error.status, error.message) if error else ("", "")
    if status == 429 or kind == "RESOURCE_EXHAUSTED":
        return errors.RateLimited(retry_after=_retry_delay(error))
    if status == 400 or kind in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        if "input token count" in message and "exceeds the maximum" in message:
            return errors.ContextLengthExceeded()
        if "thought_signature" in message or "thought signature" in message.lower():
            return errors.InvalidEncryptedContent()
        if status == 400:  # the request's fault: a /v1 client's own, passed on with its param
            named = (CLIENT_PARAMS.get(word) for word in _NAMED.findall(message))
            param = next((p for p in named if p is not None), None)
            return errors.ProviderRefused((kind or "invalid_argument").lower(), param)
    if status == 504 or kind == "DEADLINE_EXCEEDED":
        return errors.UpstreamTimeout()
    return errors.UpstreamError(f"The provider answered HTTP {status}." if status else None)


def _retry_delay(error: _ErrorDetail | None) -> str | None:
    """The delay of a ``RetryInfo`` detail (``"37s"``), in whole seconds."""
    for detail in error.details if error else ():
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        if isinstance(delay, str) and _DELAY.fullmatch(delay):
            return str(math.ceil(float(delay[:-1])))
    return None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


def _status_error(status: int, body: bytes) -> errors.TurnstoreError:
    try:
        detail = msgspec.json.decode(body, type=_ErrorBody).error
    except msgspec.DecodeError:
        detail = None
    return _error(status, detail)


def _reply(
    parts: list[msgspec.Raw], finish: str | None, blocked: str | None, usage: _Usage | None
) -> base.Reply:
    status: ReplyStatus
    reason = None
    if blocked or finish in FILTERED:
        raise errors.ContentFiltered()
    if finish == "STOP":
        status = "completed"
    elif finish == "MAX_TOKENS":
        status, reason = "incomplete", "max_output_tokens"
    else:
        raise errors.UpstreamError(
            f"The provider's reply ended for a reason turnstore does not take ({finish})."
        )
    texts = [msgspec.json.decode(part, type=_Text) for part in parts]
    text = "".join(p.text or "" for p in texts if not p.thought)
    return base.Reply(text, status, reason, parts, usage.value() if usage else None)


def _first(response: _Response) -> _Candidate | None:
    return response.candidates[0] if response.candidates else None


class _Parts:
    """A stream's parts as they grow (module docstring: how chunks join)."""

    def __init__(self) -> None:
        self.done: list[msgspec.Raw] = []
        self.bytes = 0  # of the finished parts
        self._open: dict[str, Any] | None = None

    def add(self, part: dict[str, Any]) -> Iterator[base.ProviderEvent]:
        """Take one chunk's part: the text it adds, and the reasoning part it finishes."""
        joins = self._joins(part)
        if not joins:
            yield from self.close()
            self._open = {}
        assert self._open is not None
        for key, value in part.items():
            if key == "text" and "text" in self._open:
                self._open["text"] += value
            elif key not in self._open:
                self._open[key] = value
        text = part.get("text")
        if isinstance(text, str) and text and not part.get("thought"):
            yield base.TextDelta(text)
        if set(self._open) - _TEXTUAL:
            yield from self.close()  # a call (or an image...) is whole in its chunk
        elif joins and "thoughtSignature" in part and not text:
            yield from self.close()  # a signature alone ends the text it joined

    def close(self) -> Iterator[base.ProviderEvent]:
        if self._open is None:
            return
        item = msgspec.Raw(minted(msgspec.json.encode(self._open)))
        self._open = None
        self.done.append(item)
        self.bytes += len(item)
        if GEMINI.shown(item)[0].item["type"] == "reasoning":
            yield base.ItemDone(item)  # announced before the text that follows it

    def _joins(self, part: dict[str, Any]) -> bool:
        kept = self._open
        if kept is None or not isinstance(kept.get("text"), str):
            return False
        if set(part) - _TEXTUAL:
            return False  # another kind of part
        if "thoughtSignature" in part and "thoughtSignature" in kept:
            return False  # a part carries one signature: a second one starts another
        if not part.get("text"):
            return True  # a signature alone (or nothing): it ends the text before it
        # A signature alone that opened a part stays alone: Gemini ends a text with its
        # signature, never starts one so.
        alone = "thoughtSignature" in kept and kept.get("text") == ""
        same = bool(part.get("thought")) == bool(kept.get("thought"))
        return same and not alone


class _EventStream:
    """Turns a streamed body, chunk by chunk, into provider events (its server-sent events:
    wire.py; each carries one GenerateContentResponse). The reply comes when the body ends
    (Gemini sends no closing event), if a chunk said why the reply finished."""

    def __init__(self) -> None:
        self.parts = _Parts()
        self.text_bytes = 0
        self._finish: str | None = None
        self._blocked: str | None = None
        self._usage: _Usage | None = None
        self._events = wire.ServerSentEvents()

    def feed(self, chunk: bytes) -> Iterator[base.ProviderEvent]:
        for data in self._events.feed(chunk):
            yield from self._chunk(msgspec.json.decode(data, type=_Response))

    def _chunk(self, response: _Response) -> Iterator[base.ProviderEvent]:
        if response.error is not None:
            raise _error(response.error.code, response.error)
        if response.usage_metadata is not None:
            self._usage = response.usage_metadata  # each chunk's counts are the totals so far
        if response.prompt_feedback is not None and response.prompt_feedback.block_reason:
            self._blocked = response.prompt_feedback.block_reason
        candidate = _first(response)
        if candidate is None:
            return
        self._finish = candidate.finish_reason or self._finish
        for raw in candidate.content.parts if candidate.content else ():
            part = msgspec.json.decode(raw)
            if not isinstance(part, dict):
                raise errors.UpstreamError("The provider's stream held a part that is no object.")
            for event in self.parts.add(part):
                if isinstance(event, base.TextDelta):
                    self.text_bytes += len(event.text.encode())
                yield event

    def end(self) -> Iterator[base.ProviderEvent]:
        yield from self.parts.close()
        if self._finish is None and self._blocked is None:
            raise errors.UpstreamError("The provider's stream ended before the reply was complete.")
        yield _reply(self.parts.done, self._finish, self._blocked, self._usage)


class GeminiProvider(wire.Translating):
    def __init__(
        self,
        endpoint: GeminiEndpoint,
        limits: wire.WireLimits,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        # Where this provider's parts can be replayed.
        self.origin = wire.replay_origin(
            endpoint.name, endpoint.base, endpoint.model, "gemini", endpoint.api_key
        )
        self._wire = wire.Wire(
            {"x-goog-api-key": endpoint.api_key},
            _status_error,
            ("x-request-id", "x-goog-request-id"),
            limits,
            transport,
        )

    async def respond(
        self, request: base.ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        model = request.model or self.endpoint.model
        content = generate_body(request, model)
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        with wire.translated():
            async with self._wire.post(self.endpoint.url(model, method), content) as response:
                # Leaving it (also by aclose() of this generator) closes the stream.
                if not stream:
                    body = msgspec.json.decode(await self._wire.read(response), type=_Response)
                    yield self._whole(body)
                    return
                events = _EventStream()
                async for chunk in self._wire.chunks(response):
                    for event in events.feed(chunk):
                        yield event
                    self._wire.check_reply(events.parts.bytes, events.text_bytes)
                for event in events.end():
                    yield event

    def _whole(self, body: _Response) -> base.Reply:
        candidate = _first(body)
        blocked = body.prompt_feedback.block_reason if body.prompt_feedback else None
        parts = candidate.content.parts if candidate and candidate.content else []
        kept = [msgspec.Raw(minted(bytes(part))) for part in parts]
        self._wire.check_reply(sum(map(len, kept)), 0)
        finish = candidate.finish_reason if candidate else None
        return _reply(kept, finish, blocked, body.usage_metadata)

    async def count_tokens(self, request: base.ProviderRequest) -> int:
        """``:countTokens``: the provider's count of the request."""
        model = request.model or self.endpoint.model
        content = count_body(request, model)
        with wire.translated():
            async with self._wire.post(self.endpoint.url(model, "countTokens"), content) as answer:
                body = await self._wire.read(answer)
                return msgspec.json.decode(body, type=_Counted).total_tokens
