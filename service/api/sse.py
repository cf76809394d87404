"""A turn's events as Server-Sent Events, with keep-alive comments during long silences.

The events are a run's (service/usecases/runs.py): each carries its number as the SSE ``id``, so a
client that lost its connection resumes with ``Last-Event-ID`` on any replica. A stream ends
after its terminal event (``message.done`` or ``error``). ``on_close`` runs when the stream
ends, however it ends: a turn whose client goes away is then stopped (unless it runs in the
background).

When the process is told to stop (service/platform/shutdown.py) a stream that merely follows a run
(a background turn, a resumed one) ends without a terminal event, so that graceful shutdown
can finish: its client resumes elsewhere. A turn whose client waits for it is ended by the
runs themselves, with an ``error`` event ``not_ready``, which this stream then sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Generic, Protocol, TypeVar

import anyio
import msgspec
from litestar import Request
from litestar.response import ServerSentEvent, ServerSentEventMessage, Stream
from litestar.types import Scope

from service.api.correlation import correlation_id
from service.api.errors import log_failure
from service.core.errors import Cancelled, TurnstoreError, envelope
from service.core.events import ERROR, GONE, RunEvent
from service.platform.metrics import OPEN_STREAMS
from service.platform.shutdown import SHUTDOWN
from service.usecases.runs import Started, TurnRuns

T = TypeVar("T")
log = logging.getLogger("turnstore.api")


class EventStream(ServerSentEvent):
    """Litestar's ServerSentEvent (its headers, its OpenAPI), with the messages encoded here:
    Litestar's own iterator first asks a thread for its leading fields, a hop to a thread and
    back for each stream (37% of the Litestar floor's streamed turn, bench/README.md), and
    encodes each message through a StringIO and a regex per field."""

    def __init__(
        self,
        events: AsyncIterable[ServerSentEventMessage],
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        Stream.__init__(
            self, content=_encoded(events), media_type="text/event-stream", headers=headers
        )
        self.headers.setdefault("Cache-Control", "no-cache")
        self.headers["Connection"] = "keep-alive"
        self.headers["X-Accel-Buffering"] = "no"


async def _encoded(events: AsyncIterable[ServerSentEventMessage]) -> AsyncGenerator[bytes, None]:
    async for message in events:
        yield encode(message)


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _lines(text: str) -> list[str]:
    return _LINE_BREAK.split(text) if "\n" in text or "\r" in text else [text]


def encode(message: ServerSentEventMessage) -> bytes:
    """``message`` on the wire, byte for byte as ``ServerSentEventMessage.encode()``."""
    sep, out = message.sep, list[str]()
    if message.comment is not None:
        out.extend(f": {line}{sep}" for line in _lines(str(message.comment)))
    if message.id is not None:
        out.append("".join(_lines(f"id: {message.id}")) + sep)
    if message.event is not None:
        out.append("".join(_lines(f"event: {message.event}")) + sep)
    if message.data is not None:
        data = message.data
        text = data.decode() if isinstance(data, bytes) else str(data)
        out.extend(f"data: {line}{sep}" for line in _lines(text))
    if message.retry is not None:
        out.append(f"retry: {message.retry}{sep}")
    out.append(sep)
    return "".join(out).encode()


class Stopped(Exception):
    """``with_keepalive`` was told to stop before its source ended."""


_STREAMS_KEY = "turnstore.streams"
_RELEASES_KEY = "turnstore.releases"


def closed_with_response(scope: Scope, events: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Have ``events`` closed when its response ends, however it ends. The framework stops
    iterating a stream when its client goes away or a send fails, but only a generator that
    was running at that moment hears of it: one waiting at a ``yield`` (its send blocked) would
    hold its turn until garbage collection. service/api/limits.py closes them."""
    scope.setdefault("state", {}).setdefault(_STREAMS_KEY, []).append(events)
    return events


def released_with_response(scope: Scope, release: Callable[[], Awaitable[None] | None]) -> None:
    """Have ``release`` called (and awaited, if it is a coroutine function) when the response
    ends, however it ends (a reader's slot, a stateless stream's place among the running
    turns)."""
    scope.setdefault("state", {}).setdefault(_RELEASES_KEY, []).append(release)


async def close_streams(scope: Scope) -> None:
    state = scope.get("state", {})
    try:
        for events in state.pop(_STREAMS_KEY, []):
            await events.aclose()
    finally:
        for release in state.pop(_RELEASES_KEY, []):
            released = release()
            if released is not None:
                await released


E = TypeVar("E", contravariant=True)


class Rendering(Protocol[E]):
    """How a stream's events go on the wire: /api/v1 sends a run's as they are
    (``TurnEvents``), /v1 as OpenAI's Response stream (service/api/compat/stream.py)."""

    def started(self) -> list[ServerSentEventMessage]: ...

    async def render(self, event: E) -> list[ServerSentEventMessage]: ...

    def ends(self, event: E) -> bool:
        """Whether ``event`` is the stream's last."""

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage: ...


class TurnEvents:
    """A run's events as /api/v1 sends them: each with its number as the SSE ``id``."""

    def __init__(self, correlation_id: str) -> None:
        self._correlation_id = correlation_id

    def started(self) -> list[ServerSentEventMessage]:
        return []

    async def render(self, event: RunEvent) -> list[ServerSentEventMessage]:
        return [ServerSentEventMessage(id=str(event.seq), event=event.name, data=event.data)]

    def ends(self, event: RunEvent) -> bool:
        return event.terminal

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage:
        data = envelope(exc.code, exc.message, self._correlation_id)
        return ServerSentEventMessage(event=ERROR, data=msgspec.json.encode(data).decode())


async def sse_events(
    events: AsyncGenerator[T, None],
    rendering: Rendering[T],
    keepalive_s: float,
    *,
    correlation_id: str,
    follower: bool,
    on_close: Callable[[], None] | None = None,
) -> AsyncGenerator[ServerSentEventMessage, None]:
    OPEN_STREAMS.inc()
    stop = SHUTDOWN.wait if follower else None
    try:
        for message in rendering.started():
            yield message
        async with aclosing(with_keepalive(events, keepalive_s, stop)) as items:
            async for event in items:
                if event is None:
                    yield ServerSentEventMessage(comment="keep-alive")
                    continue
                for message in await rendering.render(event):
                    yield message
                if rendering.ends(event):
                    return
    except Stopped:
        log.info("stream ended: shutting down", extra={"correlation_id": correlation_id})
    except TurnstoreError as exc:  # a run that could not be read on (e.g. its events expired)
        if exc.status >= 500:
            log_failure(exc, correlation_id)
        yield rendering.error(exc)
    except Exception:  # a failure nobody foresaw: the stream still ends with its terminal event
        log.exception("stream failed", extra={"correlation_id": correlation_id})
        yield rendering.error(TurnstoreError())
    finally:
        OPEN_STREAMS.dec()
        if on_close is not None:
            on_close()


def run_stream(
    runs: TurnRuns,
    started: Started,
    owner: str,
    rendering: Rendering[RunEvent],
    request: Request[Any, Any, Any],
    keepalive_s: float,
    headers: dict[str, str],
) -> ServerSentEvent:
    """The stream of a run just started: its events live from this process, or (an
    Idempotency-Key retry naming an earlier run) followed wherever it runs. Closing the
    stream of a turn that is not in the background stops it."""
    run = started.run
    source = run.follow() if run is not None else runs.events(started.turn_id, owner, 0)
    background = run is None or run.new.background
    on_close = None if background else (lambda: run.stop(Cancelled(GONE)))  # type: ignore[union-attr]
    events = sse_events(
        source,
        rendering,
        keepalive_s,
        correlation_id=correlation_id(request.scope),
        follower=background,
        on_close=on_close,
    )
    closed_with_response(request.scope, events)
    return EventStream(events, headers=headers)


async def with_keepalive(
    source: AsyncGenerator[T, None],
    interval_s: float,
    stop: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[T | None, None]:
    """Items of ``source``, with None whenever it stays silent for ``interval_s``; raises
    Stopped (after closing ``source``) as soon as ``stop()`` completes. An item that is ready
    wins over ``stop``."""
    feed = _Feed(source, interval_s, stop)
    try:
        while True:
            kind, value = await feed.next()
            if kind == _ITEM:
                yield value
            elif kind == _SILENT:
                yield None
            elif kind == _END:
                return
            elif kind == _FAILED:
                raise value
            if feed.stopped:
                raise Stopped()
    finally:
        await feed.close()


_ITEM, _SILENT, _END, _FAILED, _STOP = range(5)  # what the pump or the timers put in


class _Feed(Generic[T]):
    """What ``with_keepalive`` takes its items from: ``source`` is read by one task of its
    own, one item ahead at most, so a keep-alive never interrupts a slow source; keep-alives
    come from one timer, re-armed only when it fires. An item costs no timer and no task
    (each had a task and an ``asyncio.wait`` of its own: a streamed turn sends several)."""

    def __init__(
        self,
        source: AsyncGenerator[T, None],
        interval_s: float,
        stop: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._source, self._interval_s = source, interval_s
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=1)
        self._last = self._loop.time()  # when the consumer last got something
        self._pumping = asyncio.ensure_future(self._pump())
        self._pumping.add_done_callback(self._pumped)
        self._timer = self._loop.call_at(self._last + interval_s, self._tick)
        self._stopping = asyncio.ensure_future(stop()) if stop is not None else None
        if self._stopping is not None:
            self._stopping.add_done_callback(self._stop)

    @property
    def stopped(self) -> bool:
        return self._stopping is not None and self._stopping.done()

    async def next(self) -> tuple[int, Any]:
        got = await self._ready.get()
        self._last = self._loop.time()
        return got

    async def close(self) -> None:
        self._timer.cancel()
        with anyio.CancelScope(shield=True):
            for task in (self._stopping, self._pumping):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await self._source.aclose()

    async def _pump(self) -> None:
        try:
            async for item in self._source:
                await self._ready.put((_ITEM, item))
            await self._ready.put((_END, None))
        except Exception as exc:  # the consumer raises it
            await self._ready.put((_FAILED, exc))

    def _tick(self) -> None:
        now, due = self._loop.time(), self._last + self._interval_s
        if now >= due:
            if self._ready.empty():  # else something is there to take already
                self._ready.put_nowait((_SILENT, None))
            due = now + self._interval_s
        self._timer = self._loop.call_at(due, self._tick)

    def _stop(self, _: object) -> None:
        if self._ready.empty():  # else it is seen once the item is taken
            self._ready.put_nowait((_STOP, None))

    def _pumped(self, task: asyncio.Future[None]) -> None:
        if task.cancelled() and self._ready.empty():  # not by close(): do not wait on
            self._ready.put_nowait((_FAILED, asyncio.CancelledError()))
