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
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field

import httpx
import msgspec

from service.core import errors
from service.core.items import compaction_item
from service.core.model import Origin, ReplyStatus, fingerprint
from service.core.usage import Usage
from service.providers import base
from service.providers.wire import ServerSentEvents, Wire, WireLimits, translated

log = logging.getLogger("turnstore.provider")

_INCOMPLETE_REASONS = ("max_output_tokens", "content_filter")
_CODES: dict[str, type[errors.TurnstoreError]] = {
    "context_length_exceeded": errors.ContextLengthExceeded,
    "content_filter": errors.ContentFiltered,  # Azure
    "content_policy_violation": errors.ContentFiltered,
    "rate_limit_exceeded": errors.RateLimited,
    "invalid_encrypted_content": errors.InvalidEncryptedContent,
}


@dataclass(frozen=True)
class Endpoint:
    name: str  # the provider's: "openai" or "azure", or its name in PROVIDERS_FILE
    url: str
    headers: dict[str, str] = field(repr=False)  # they hold the API key
    model: str
    kind: str = "openai"  # or "azure"
    key_fingerprint: str | None = None  # of the key in the headers (core.model.fingerprint)

    @classmethod
    def openai(
        cls, base_url: str, api_key: str | None, model: str, name: str = "openai"
    ) -> Endpoint:
        """OpenAI's API or a server speaking it (without a key: no Authorization header)."""
        url = base_url.rstrip("/") + "/responses"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return cls(name, url, headers, model, "openai", fingerprint(api_key))

    @classmethod
    def azure(cls, endpoint: str, api_key: str, deployment: str, name: str = "azure") -> Endpoint:
        url = endpoint.rstrip("/") + "/openai/v1/responses"
        return cls(name, url, {"api-key": api_key}, deployment, "azure", fingerprint(api_key))


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


class ResponsesProvider(base.Provider):
    def __init__(
        self,
        endpoint: Endpoint,
        limits: WireLimits,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        # Where this provider's sealed reasoning can be opened again (no credentials in it).
        url = httpx.URL(endpoint.url).copy_with(userinfo=b"")
        self.origin = Origin(
            endpoint.name, str(url), endpoint.model, endpoint.kind, endpoint.key_fingerprint
        )
        self._wire = Wire(
            endpoint.headers, _status_error, ("x-request-id", "apim-request-id"), limits, transport
        )

    async def close(self) -> None:
        await self._wire.close()

    async def respond(
        self, request: base.ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        content = base.encode_request(self.endpoint.model, request, stream=stream)
        with translated():
            async with self._wire.post(self.endpoint.url, content) as response:
                # Leaving it (also by aclose() of this generator) closes the stream.
                if not stream:
                    body = msgspec.json.decode(await self._wire.read(response), type=_Response)
                    self._wire.check_reply(sum(map(len, body.output)), 0)
                    yield _reply(body)
                    return
                events = _EventStream()
                async for chunk in self._wire.chunks(response):
                    for event in events.feed(chunk):
                        yield event
                    self._wire.check_reply(sum(map(len, events.items)), events.text_bytes)
                    if events.finished:
                        return
        raise errors.UpstreamError("The provider's stream ended before the response was complete.")

    async def compact(self, request: base.ProviderRequest) -> base.Compacted:
        """``POST {base}/responses/compact``: the compacted context, and its usage."""
        content = base.encode_compaction(self.endpoint.model, request)
        with translated():
            async with self._wire.post(f"{self.endpoint.url}/compact", content) as response:
                body = msgspec.json.decode(await self._wire.read(response), type=_Compaction)
        # Its output repeats the user messages it keeps, which may be most of the input: a
        # compaction may answer what it was sent, and a reply's worth more.
        self._wire.check_reply(sum(map(len, body.output)), 0, sent=len(content))
        if compaction_item(body.output) is None:
            raise errors.UpstreamError("The provider's compaction holds no compaction item.")
        return base.Compacted(list(body.output), body.usage.value() if body.usage else None)

    async def count_tokens(self, request: base.ProviderRequest) -> int:
        """``POST {base}/responses/input_tokens``: the provider's count of the request."""
        content = base.encode_count(self.endpoint.model, request)
        with translated():
            async with self._wire.post(f"{self.endpoint.url}/input_tokens", content) as response:
                body = await self._wire.read(response)
                return msgspec.json.decode(body, type=_Counted).input_tokens


def _status_error(status: int, body: bytes) -> errors.TurnstoreError:
    if status == 429:
        return errors.RateLimited()  # its Retry-After: the wire's
    if status == 400:  # the body's error code tells which 400 it is
        try:
            error = msgspec.json.decode(body, type=_ErrorBody).error
        except msgspec.DecodeError:
            error = None
        if error is not None and error.code in _CODES:
            return _CODES[error.code]()
        if error is not None and error.param:  # a field of the request it names
            return errors.ProviderRefused(error.code, error.param)
    return errors.UpstreamError(f"The provider answered HTTP {status}.")


class _EventStream:
    """Turns a streamed body, chunk by chunk, into provider events (its server-sent events:
    wire.py). Text comes from the deltas, output items from ``response.output_item.done`` (the
    ``.added`` copy of an item is not complete yet)."""

    def __init__(self) -> None:
        self.finished = False
        self.items: list[msgspec.Raw] = []  # from response.output_item.done, in order
        self.text_bytes = 0  # of the text deltas so far
        self._events = ServerSentEvents()

    def feed(self, chunk: bytes) -> Iterator[base.ProviderEvent]:
        return self._events.events(chunk, self._event, lambda: self.finished)

    def _event(self, data: bytes) -> base.ProviderEvent | None:
        kind = msgspec.json.decode(data, type=_Event).type
        if kind == "response.output_text.delta":
            event = msgspec.json.decode(data, type=_Delta)
            self.text_bytes += len(event.delta.encode())
            return base.TextDelta(event.delta, event.item_id) if event.delta else None
        if kind == "response.output_item.done":
            item = msgspec.json.decode(data, type=_ItemDone).item
            self.items.append(item)
            if msgspec.json.decode(item, type=_Item).type in _ANNOUNCED:
                return base.ItemDone(item)  # a stream announces it before the message after it
        elif kind in ("response.completed", "response.incomplete"):
            final = msgspec.json.decode(data, type=_Finished).response
            self.finished = True
            return _reply(
                _Response(final.status, self.items, final.incomplete_details, final.usage)
            )
        elif kind == "response.failed":
            raise errors.UpstreamError("The provider failed to produce a response.")
        elif kind == "error":
            error = msgspec.json.decode(data, type=_Error)
            code = error.code or (error.error.code if error.error else None)
            raise _CODES.get(code or "", errors.UpstreamError)()
        return None


def _reply(response: _Response) -> base.Reply:
    reason = response.incomplete_details.reason if response.incomplete_details else None
    status: ReplyStatus
    if response.status == "completed":
        status, reason = "completed", None
    elif response.status == "incomplete" and reason in _INCOMPLETE_REASONS:
        status = "incomplete"
    elif response.status == "failed":
        raise errors.UpstreamError("The provider failed to produce a response.")
    else:
        raise errors.UpstreamError("The provider's response was neither completed nor incomplete.")
    usage = response.usage.value() if response.usage else None
    return base.Reply(_text(response.output), status, reason, list(response.output), usage)


def _text(items: list[msgspec.Raw]) -> str:
    """The output text of the message items (what the SDKs call ``output_text``)."""
    texts: list[str] = []
    for raw in items:
        item = msgspec.json.decode(raw, type=_Item)
        if item.type == "message":
            parts = msgspec.json.decode(item.content, type=list[_Part])
            texts += [part.text for part in parts if part.type == "output_text"]
    return "".join(texts)
