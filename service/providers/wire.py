"""What every HTTP provider adapter does alike: its POSTs and their limits (``Wire``), server-
sent events (``ServerSentEvents``), httpx's exception hierarchy and malformed JSON mapped onto
the domain's, a plain Retry-After passed on, the provider let join the trace.

httpx's hierarchy, mapped in one place (``translated``)::

    httpx.HTTPError
     +-- TimeoutException (Connect/Read/Write/PoolTimeout)   -> UpstreamTimeout
     +-- every other one (ConnectError, ReadError,
         RemoteProtocolError, ProxyError, DecodingError...)  -> UpstreamError
    msgspec.DecodeError, RecursionError (unparsable,
        mis-shaped or absurdly deep JSON)                    -> UpstreamError
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import msgspec
from opentelemetry import propagate, trace

from service.core.errors import (
    CompactionUnsupported,
    RateLimited,
    TurnstoreError,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.model import Origin, fingerprint
from service.providers.base import Compacted, Provider, ProviderRequest

log = logging.getLogger("turnstore.provider")
T = TypeVar("T")

# A stream's last bytes after its final event (the chunked body's end, a `[DONE]`) are read
# before the connection goes back to the pool; not there within this long, it is closed.
REST_S = 0.1

# Retry-After as delay-seconds or an IMF-fixdate; anything else is not passed on.
_RETRY_AFTER = re.compile(
    r"\d{1,9}|[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", re.A
)


def retry_after(value: str | None) -> str | None:
    """Pass on a plain Retry-After (delay-seconds or HTTP-date), nothing else."""
    value = (value or "").strip()
    return value if _RETRY_AFTER.fullmatch(value) else None


def trace_headers() -> dict[str, str]:
    """The W3C traceparent of the current span, so the provider may join the trace; nothing
    else of the client's context (its tracestate and baggage stay here)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}


@contextmanager
def translated() -> Iterator[None]:
    """Map httpx's exception hierarchy and malformed JSON onto the domain's."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout() from exc
    except httpx.HTTPError as exc:
        raise UpstreamError("The provider could not be reached or broke off.") from exc
    except (msgspec.DecodeError, RecursionError) as exc:  # malformed, or nested absurdly deep
        raise UpstreamError("The provider answered something unparsable.") from exc


@dataclass(frozen=True)
class WireLimits:
    """How long a provider may take, and how much it may send: a reply of at most
    ``max_body_bytes`` of items (or streamed text), on the wire at most ``max_wire_bytes``
    (default: a multiple of it; a stream repeats its text)."""

    connect_timeout_s: float
    read_timeout_s: float
    max_body_bytes: int
    max_wire_bytes: int | None = None


@dataclass(frozen=True)
class HostedEndpoint:
    """A hosted API's endpoint (Anthropic's, Gemini's): the provider's name (its kind, or its
    name in PROVIDERS_FILE), its base URL (None or "": the API's own), key and model."""

    name: str
    base_url: str | None
    api_key: str = field(repr=False)
    model: str

    def root(self, default: str) -> str:
        """The base URL, ``default`` unless one was given, without a trailing slash."""
        return (self.base_url or default).rstrip("/")


def replay_origin(name: str, url: str, model: str, kind: str, api_key: str | None) -> Origin:
    """Where a provider's items can be replayed: its name, ``url`` with no credentials in it,
    the model, its kind and its key's fingerprint (never the key)."""
    plain = httpx.URL(url).copy_with(userinfo=b"")
    return Origin(name, str(plain), model, kind, fingerprint(api_key))


# A non-2xx answer as the adapter's domain error: its status and its body (b"" when it could
# not be read). A RateLimited one gets the answer's Retry-After here, for every adapter.
ErrorOf = Callable[[int, bytes], TurnstoreError]


class Answer:
    """A provider's answer as it is read: its bytes come from one iterator, so that a reading
    that stopped (a stream at its final event) can be taken up again."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.bytes = response.aiter_bytes()
        self.size = 0  # read so far


class Wire:
    """One provider's HTTP: POSTs with its headers and the trace's, a non-2xx answer raised as
    the adapter's domain error (``error_of``), every answer read under its ``limits``."""

    def __init__(
        self,
        headers: dict[str, str],
        error_of: ErrorOf,
        request_ids: tuple[str, ...],
        limits: WireLimits,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._headers = {**headers, "content-type": "application/json"}
        # The headers the provider's own id of a request may come in (for its support), in order.
        self._error_of, self._request_ids = error_of, request_ids
        self.max_body_bytes = body = limits.max_body_bytes
        self._max_wire_bytes = limits.max_wire_bytes or max(8 * body, 16 * 1024 * 1024)
        timeout = httpx.Timeout(limits.read_timeout_s, connect=limits.connect_timeout_s)
        pool = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        self._client = httpx.AsyncClient(timeout=timeout, limits=pool, transport=transport)

    @asynccontextmanager
    async def post(self, url: str, content: bytes) -> AsyncIterator[Answer]:
        """One POST, its answer open while the block runs (leaving it closes the stream, once
        what is left of it is read when the block ran to its end: ``_rest``)."""
        headers = {**self._headers, **trace_headers()}
        async with self._client.stream("POST", url, content=content, headers=headers) as response:
            answer = Answer(response)
            request_id = self._request_id(response.headers)
            span = trace.get_current_span()
            span.set_attribute("http.response.status_code", response.status_code)
            if request_id:
                span.set_attribute("provider.request_id", request_id)
            if not response.is_success:
                try:
                    body = await self.read(answer)
                except UpstreamError:
                    body = b""
                error = self._error_of(response.status_code, body)
                if isinstance(error, RateLimited):
                    said = retry_after(response.headers.get("retry-after"))
                    error.retry_after = said or error.retry_after
                log.warning(
                    "provider answered HTTP %s: %s",
                    response.status_code,
                    error.code,
                    extra={"provider_request_id": request_id},
                )
                raise error
            log.debug("provider answering", extra={"provider_request_id": request_id})
            yield answer
            await self._rest(answer)

    async def _rest(self, answer: Answer) -> None:
        """What is left of an answer its adapter is done with (a stream stops reading at its
        final event), read to its end so that httpx keeps the connection for the next request:
        closed unread, it is closed, and every streamed turn would pay a new connection (a TLS
        handshake to a real provider). Only when the adapter finished: a stream left by an
        error or a cancelled turn is closed at once (the upstream request with it)."""
        if answer.response.is_closed:
            return
        with contextlib.suppress(TimeoutError, httpx.HTTPError, UpstreamError):
            async with asyncio.timeout(REST_S):
                async for _ in self.chunks(answer):
                    pass

    def _request_id(self, headers: httpx.Headers) -> str | None:
        found: str | None = None
        for name in self._request_ids:
            found = headers.get(name)
            if found:
                break
        return found

    async def chunks(self, answer: Answer) -> AsyncIterator[bytes]:
        """The answer's bytes as they come, from where the last reading stopped; UpstreamError
        once past the wire cap."""
        async for chunk in answer.bytes:
            answer.size += len(chunk)
            if answer.size > self._max_wire_bytes:
                raise UpstreamError("The provider's response was too large.")
            yield chunk

    async def read(self, answer: Answer) -> bytes:
        return b"".join([chunk async for chunk in self.chunks(answer)])

    def check_reply(self, reply_bytes: int, text_bytes: int, sent: int = 0) -> None:
        """Refuse a reply whose items or streamed text outgrew the limit (and ``sent`` bytes
        more, for what a reply may repeat of its request)."""
        if max(reply_bytes, text_bytes) > self.max_body_bytes + sent:
            raise UpstreamError("The provider's reply was too large.")

    async def close(self) -> None:
        await self._client.aclose()


class ServerSentEvents:
    """Server-sent events from chunks as they come: lines end in LF or CRLF, a blank line ends
    an event, and only ``data`` lines matter (each JSON carries its ``type``)."""

    def __init__(self) -> None:
        self._line: list[bytes] = []  # the start of a line that has not ended yet
        self._data: list[bytes] = []  # the data lines of the event that has not ended yet

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The data of each event ``chunk`` ends (a caller may stop reading at any one)."""
        *ended, rest = chunk.split(b"\n")
        for end in ended:
            line = b"".join([*self._line, end]).removesuffix(b"\r")
            self._line.clear()
            if line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" "))
            elif not line and self._data:
                data = b"\n".join(self._data)
                self._data.clear()
                yield data
        if rest:
            self._line.append(rest)

    def events(
        self, chunk: bytes, read: Callable[[bytes], T | None], finished: Callable[[], bool]
    ) -> Iterator[T]:
        """What ``read`` makes of each event ``chunk`` ends, until ``finished``."""
        for data in self.feed(chunk):
            event = read(data)
            if event is not None:
                yield event
            if finished():
                return


class Translating(Provider):
    """What the adapters of an API other than the Responses API (Anthropic's, Gemini's, a Chat
    server's: they translate the request) do alike: none compacts (``context_management`` is
    400 with its param), each is shown by its origin (never its key) and closes its wire."""

    _wire: Wire

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.origin!r})"

    def compacts(self, model: str | None) -> bool:
        return False

    async def compact(self, request: ProviderRequest) -> Compacted:
        raise CompactionUnsupported()

    async def close(self) -> None:
        await self._wire.close()
