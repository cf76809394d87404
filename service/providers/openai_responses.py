"""OpenAI / Azure OpenAI Responses API over httpx, with ``store=false``.

One POST per call, never retried. With ``stream=True`` the body is read as server-sent events,
else as one JSON response. Either way the reply (its output items, and a stream's text
deltas) may not grow past ``max_body_bytes``, so both modes allow the same reply; the bytes on
the wire (a stream repeats the text about five times) are capped at ``max_wire_bytes``. Both
are checked as the body arrives. Output items are kept as the raw bytes the provider sent.

Failures become domain errors, with messages of our own (provider bodies never reach the
client). httpx's exception hierarchy and malformed JSON map as in every adapter
(service/providers/wire.py); what the provider says maps as: HTTP 429 -> RateLimited (with a
plain Retry-After); an HTTP 400 or a stream ``error`` event whose code is in ``_CODES`` -> that
error (e.g. invalid_encrypted_content -> InvalidEncryptedContent, which the use case retries
once without sealed reasoning); any other non-2xx, a ``failed`` response or a stream without
terminal event -> UpstreamError. An ``incomplete`` reply (max_output_tokens, content_filter) is
a Reply: the use case decides what commits.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import msgspec
from opentelemetry import trace

from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    InvalidEncryptedContent,
    ProviderRefused,
    RateLimited,
    TurnstoreError,
    UpstreamError,
)
from service.core.items import compaction_item
from service.core.model import Origin, ReplyStatus
from service.core.usage import Usage
from service.providers.base import (
    Compacted,
    ItemDone,
    ProviderEvent,
    ProviderRequest,
    Reply,
    TextDelta,
    encode_compaction,
    encode_count,
    encode_request,
)
from service.providers.wire import retry_after, trace_headers, translated

log = logging.getLogger("turnstore.provider")

_INCOMPLETE_REASONS = ("max_output_tokens", "content_filter")
_CODES: dict[str, type[TurnstoreError]] = {
    "context_length_exceeded": ContextLengthExceeded,
    "content_filter": ContentFiltered,  # Azure
    "content_policy_violation": ContentFiltered,
    "rate_limit_exceeded": RateLimited,
    "invalid_encrypted_content": InvalidEncryptedContent,
}


@dataclass(frozen=True)
class Endpoint:
    name: str  # the provider's: "openai" or "azure", or its name in PROVIDERS_FILE
    url: str
    headers: dict[str, str] = field(repr=False)  # they hold the API key
    model: str

    @classmethod
    def openai(
        cls, base_url: str, api_key: str | None, model: str, name: str = "openai"
    ) -> Endpoint:
        """OpenAI's API or a server speaking it (without a key: no Authorization header)."""
        url = base_url.rstrip("/") + "/responses"
        return cls(name, url, {"Authorization": f"Bearer {api_key}"} if api_key else {}, model)

    @classmethod
    def azure(cls, endpoint: str, api_key: str, deployment: str, name: str = "azure") -> Endpoint:
        url = endpoint.rstrip("/") + "/openai/v1/responses"
        return cls(name, url, {"api-key": api_key}, deployment)


class _ErrorDetail(msgspec.Struct):
    code: str | None = None
    param: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


class _IncompleteDetails(msgspec.Struct):
    reason: str | None = None


class _InputDetails(msgspec.Struct):
    cached_tokens: int = 0


class _OutputDetails(msgspec.Struct):
    reasoning_tokens: int = 0


# The output items a stream announces as the provider finishes them (the message is announced
# as its text starts; function calls, whole, at the end).
_ANNOUNCED = frozenset({"reasoning", "compaction"})


class _Counted(msgspec.Struct):
    input_tokens: int


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    input_tokens_details: _InputDetails | None = None
    output_tokens: int = 0
    output_tokens_details: _OutputDetails | None = None
    total_tokens: int = 0

    def value(self) -> Usage:
        cached = self.input_tokens_details.cached_tokens if self.input_tokens_details else 0
        details = self.output_tokens_details
        reasoning = details.reasoning_tokens if details else 0
        total = self.total_tokens or self.input_tokens + self.output_tokens
        return Usage(self.input_tokens, cached, self.output_tokens, reasoning, total)


class _Response(msgspec.Struct):
    status: str | None = None
    output: list[msgspec.Raw] = []
    incomplete_details: _IncompleteDetails | None = None
    usage: _Usage | None = None


class _Compaction(msgspec.Struct):
    output: list[msgspec.Raw]
    usage: _Usage | None = None


class _Item(msgspec.Struct):
    type: str = ""
    content: msgspec.Raw = msgspec.Raw()  # parts, read for messages only


class _Part(msgspec.Struct):
    type: str = ""
    text: str = ""


# Stream events: the type first, then only the events used, each with only the fields used.
class _Event(msgspec.Struct):
    type: str


class _Delta(msgspec.Struct):
    delta: str
    item_id: str | None = None


class _ItemDone(msgspec.Struct):
    item: msgspec.Raw


class _Finished(msgspec.Struct):
    response: _Response


class _Error(msgspec.Struct):
    code: str | None = None
    error: _ErrorDetail | None = None  # some servers nest it


class ResponsesProvider:
    def __init__(
        self,
        endpoint: Endpoint,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_body_bytes: int,
        max_wire_bytes: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        # Where this provider's sealed reasoning can be opened again (no credentials in it).
        url = httpx.URL(endpoint.url).copy_with(userinfo=b"")
        self.origin = Origin(endpoint.name, str(url), endpoint.model)
        self._headers = {**endpoint.headers, "Content-Type": "application/json"}
        self._max_body_bytes = max_body_bytes  # the reply: output items, text deltas
        self._max_wire_bytes = max_wire_bytes or max(8 * max_body_bytes, 16 * 1024 * 1024)
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)

    def origin_for(self, model: str | None) -> Origin:
        return self.origin.with_model(model)

    def compacts(self, model: str | None) -> bool:
        return True

    async def close(self) -> None:
        await self._client.aclose()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        content = encode_request(self.endpoint.model, request, stream=stream)
        with translated():
            async with self._call(self.endpoint.url, content) as response:
                # Leaving it (also by aclose() of this generator) closes the stream.
                if not stream:
                    body = msgspec.json.decode(await self._read(response), type=_Response)
                    self._check_reply(body.output, 0)
                    yield _reply(body)
                    return
                events, size = _EventStream(), 0
                async for chunk in response.aiter_bytes():
                    size = self._count(size, chunk)
                    for event in events.feed(chunk):
                        yield event
                    self._check_reply(events.items, events.text_bytes)
                    if events.finished:
                        return
        raise UpstreamError("The provider's stream ended before the response was complete.")

    async def compact(self, request: ProviderRequest) -> Compacted:
        """``POST {base}/responses/compact``: the compacted context, and its usage."""
        content = encode_compaction(self.endpoint.model, request)
        with translated():
            async with self._call(f"{self.endpoint.url}/compact", content) as response:
                body = msgspec.json.decode(await self._read(response), type=_Compaction)
        # Its output repeats the user messages it keeps, which may be most of the input: a
        # compaction may answer what it was sent, and a reply's worth more.
        self._check_reply(body.output, 0, sent=len(content))
        if compaction_item(body.output) is None:
            raise UpstreamError("The provider's compaction holds no compaction item.")
        return Compacted(list(body.output), body.usage.value() if body.usage else None)

    async def count_tokens(self, request: ProviderRequest) -> int:
        """``POST {base}/responses/input_tokens``: the provider's count of the request."""
        content = encode_count(self.endpoint.model, request)
        with translated():
            async with self._call(f"{self.endpoint.url}/input_tokens", content) as response:
                return msgspec.json.decode(await self._read(response), type=_Counted).input_tokens

    @asynccontextmanager
    async def _call(self, url: str, content: bytes) -> AsyncIterator[httpx.Response]:
        """One POST to the provider, its answer open while the block runs (a non-2xx answer
        raised as its domain error)."""
        headers = {**self._headers, **trace_headers()}
        async with self._client.stream("POST", url, content=content, headers=headers) as response:
            request_id = _request_id(response)
            span = trace.get_current_span()
            span.set_attribute("http.response.status_code", response.status_code)
            if request_id:
                span.set_attribute("provider.request_id", request_id)
            if not response.is_success:
                error = await self._status_error(response)
                log.warning(
                    "provider answered HTTP %s: %s",
                    response.status_code,
                    error.code,
                    extra={"provider_request_id": request_id},
                )
                raise error
            log.debug("provider answering", extra={"provider_request_id": request_id})
            yield response

    async def _read(self, response: httpx.Response) -> bytes:
        body, size = [], 0
        async for chunk in response.aiter_bytes():
            size = self._count(size, chunk)
            body.append(chunk)
        return b"".join(body)

    def _count(self, size: int, chunk: bytes) -> int:
        """The bytes read so far with ``chunk``; refuse them once over the wire cap."""
        size += len(chunk)
        if size > self._max_wire_bytes:
            raise UpstreamError("The provider's response was too large.")
        return size

    def _check_reply(self, items: list[msgspec.Raw], text_bytes: int, sent: int = 0) -> None:
        """Refuse a reply whose output items or streamed text outgrew the limit (and ``sent``
        bytes more, for what a reply may repeat of its request)."""
        if max(sum(map(len, items)), text_bytes) > self._max_body_bytes + sent:
            raise UpstreamError("The provider's reply was too large.")

    async def _status_error(self, response: httpx.Response) -> TurnstoreError:
        if response.status_code == 429:
            return RateLimited(retry_after=retry_after(response.headers.get("retry-after")))
        if response.status_code == 400:  # the body's error code tells which 400 it is
            try:
                error = msgspec.json.decode(await self._read(response), type=_ErrorBody).error
            except (msgspec.DecodeError, UpstreamError):
                error = None
            if error is not None and error.code in _CODES:
                return _CODES[error.code]()
            if error is not None and error.param:  # a field of the request it names
                return ProviderRefused(error.code, error.param)
        return UpstreamError(f"The provider answered HTTP {response.status_code}.")


def _request_id(response: httpx.Response) -> str | None:
    """The provider's own id of the request (OpenAI's, or Azure's), for its support."""
    found: str | None = response.headers.get("x-request-id") or response.headers.get(
        "apim-request-id"
    )
    return found


class _EventStream:
    """Turns a streamed body, chunk by chunk, into provider events.

    Server-sent events: lines end in LF or CRLF, a blank line ends an event, and only ``data``
    lines matter (each JSON carries its ``type``). Text comes from the deltas, output items
    from ``response.output_item.done`` (the ``.added`` copy of an item is not complete yet).
    """

    def __init__(self) -> None:
        self.finished = False
        self.items: list[msgspec.Raw] = []  # from response.output_item.done, in order
        self.text_bytes = 0  # of the text deltas so far
        self._line: list[bytes] = []  # the start of a line that has not ended yet
        self._data: list[bytes] = []  # the data lines of the event that has not ended yet

    def feed(self, chunk: bytes) -> Iterator[ProviderEvent]:
        *ended, rest = chunk.split(b"\n")
        for end in ended:
            line = b"".join([*self._line, end]).removesuffix(b"\r")
            self._line.clear()
            if line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" "))
            elif not line and self._data:
                event = self._event(b"\n".join(self._data))
                self._data.clear()
                if event is not None:
                    yield event
                if self.finished:
                    return
        if rest:
            self._line.append(rest)

    def _event(self, data: bytes) -> ProviderEvent | None:
        kind = msgspec.json.decode(data, type=_Event).type
        if kind == "response.output_text.delta":
            event = msgspec.json.decode(data, type=_Delta)
            self.text_bytes += len(event.delta.encode())
            return TextDelta(event.delta, event.item_id) if event.delta else None
        if kind == "response.output_item.done":
            item = msgspec.json.decode(data, type=_ItemDone).item
            self.items.append(item)
            if msgspec.json.decode(item, type=_Item).type in _ANNOUNCED:
                return ItemDone(item)  # a stream announces it before the message after it
        elif kind in ("response.completed", "response.incomplete"):
            final = msgspec.json.decode(data, type=_Finished).response
            self.finished = True
            return _reply(
                _Response(final.status, self.items, final.incomplete_details, final.usage)
            )
        elif kind == "response.failed":
            raise UpstreamError("The provider failed to produce a response.")
        elif kind == "error":
            error = msgspec.json.decode(data, type=_Error)
            code = error.code or (error.error.code if error.error else None)
            raise _CODES.get(code or "", UpstreamError)()
        return None


def _reply(response: _Response) -> Reply:
    reason = response.incomplete_details.reason if response.incomplete_details else None
    status: ReplyStatus
    if response.status == "completed":
        status, reason = "completed", None
    elif response.status == "incomplete" and reason in _INCOMPLETE_REASONS:
        status = "incomplete"
    elif response.status == "failed":
        raise UpstreamError("The provider failed to produce a response.")
    else:
        raise UpstreamError("The provider's response was neither completed nor incomplete.")
    usage = response.usage.value() if response.usage else None
    return Reply(_text(response.output), status, reason, list(response.output), usage)


def _text(items: list[msgspec.Raw]) -> str:
    """The output text of the message items (what the SDKs call ``output_text``)."""
    texts: list[str] = []
    for raw in items:
        item = msgspec.json.decode(raw, type=_Item)
        if item.type == "message":
            parts = msgspec.json.decode(item.content, type=list[_Part])
            texts += [part.text for part in parts if part.type == "output_text"]
    return "".join(texts)
