"""A turn's events as Server-Sent Events, with keep-alive comments during long silences.

The events are a run's (service/runs.py): each carries its number as the SSE ``id``, so a
client that lost its connection resumes with ``Last-Event-ID`` on any replica. A stream ends
after its terminal event (``message.done`` or ``error``). ``on_close`` runs when the stream
ends, however it ends: a turn whose client goes away is then stopped (unless it runs in the
background).

When the process is told to stop (service/shutdown.py) a stream that merely follows a run
(a background turn, a resumed one) ends without a terminal event, so that graceful shutdown
can finish: its client resumes elsewhere. A turn whose client waits for it is ended by the
runs themselves, with an ``error`` event ``not_ready``, which this stream then sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
import msgspec
from litestar.response import ServerSentEventMessage
from litestar.types import Scope

from service.api.errors import log_failure
from service.core.errors import TurnstoreError, envelope
from service.core.model import RunEvent
from service.platform.metrics import OPEN_STREAMS
from service.platform.shutdown import SHUTDOWN

T = TypeVar("T")
log = logging.getLogger("turnstore.api")


class Stopped(Exception):
    """``with_keepalive`` was told to stop before its source ended."""


_STREAMS_KEY = "turnstore.streams"


def closed_with_response(scope: Scope, events: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Have ``events`` closed when its response ends, however it ends. The framework stops
    iterating a stream when its client goes away or a send fails, but only a generator that
    was running at that moment hears of it: one waiting at a ``yield`` (its send blocked) would
    hold its turn until garbage collection. service/api/limits.py closes them."""
    scope.setdefault("state", {}).setdefault(_STREAMS_KEY, []).append(events)
    return events


async def close_streams(scope: Scope) -> None:
    for events in scope.get("state", {}).pop(_STREAMS_KEY, []):
        await events.aclose()


TERMINAL = frozenset({"message.done", "error"})


async def sse_events(
    events: AsyncGenerator[RunEvent, None],
    correlation_id: str,
    keepalive_s: float,
    *,
    follower: bool,
    on_close: Callable[[], None] | None = None,
) -> AsyncGenerator[ServerSentEventMessage, None]:
    OPEN_STREAMS.inc()
    stop = SHUTDOWN.wait if follower else None
    try:
        async with aclosing(with_keepalive(events, keepalive_s, stop)) as items:
            async for event in items:
                if event is None:
                    yield ServerSentEventMessage(comment="keep-alive")
                    continue
                yield ServerSentEventMessage(id=str(event.seq), event=event.name, data=event.data)
                if event.name in TERMINAL:
                    return
    except Stopped:
        log.info("stream ended: shutting down", extra={"correlation_id": correlation_id})
    except TurnstoreError as exc:  # a run that could not be read on (e.g. its events expired)
        if exc.status >= 500:
            log_failure(exc, correlation_id)
        data = msgspec.json.encode(envelope(exc.code, exc.message, correlation_id)).decode()
        yield ServerSentEventMessage(event="error", data=data)
    finally:
        OPEN_STREAMS.dec()
        if on_close is not None:
            on_close()


async def with_keepalive(
    source: AsyncGenerator[T, None],
    interval_s: float,
    stop: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[T | None, None]:
    """Items of ``source``, with None whenever it stays silent for ``interval_s``; raises
    Stopped (after closing ``source``) as soon as ``stop()`` completes.

    The pending ``__anext__`` runs as a task that a timeout does not cancel, so a slow
    source is never interrupted by a keep-alive. An item that is ready wins over ``stop``.
    """
    pending: asyncio.Future[T] | None = None
    stopping = asyncio.ensure_future(stop()) if stop is not None else None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            waiting: set[asyncio.Future[Any]] = (
                {pending} if stopping is None else {pending, stopping}
            )
            done, _ = await asyncio.wait(
                waiting, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                yield None
                continue
            if pending not in done:
                raise Stopped()
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            for task in (stopping, pending):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await source.aclose()
