"""Turn events as Server-Sent Events, with keep-alive comments during long silences.

A client disconnect cancels this generator; its ``finally`` then closes the turn's event
iterator, which cancels the provider call and releases the conversation lock. Exactly one
terminal event (``message.done`` or ``error``) ends a stream that runs to its end.

When the process is told to stop (service/shutdown.py), an open stream ends the same way as
on a disconnect, and then sends an ``error`` event with code ``not_ready`` instead of being
cut off: graceful shutdown waits for open requests, so a stream must end for the process to.
A turn whose commit had already begun is committed first (the commit is never interrupted).
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

from service.api.errors import envelope
from service.api.schemas import MessageDone
from service.errors import TurnstoreError
from service.exchange import ToolCalled
from service.metrics import OPEN_STREAMS
from service.providers.base import TextDelta
from service.shutdown import SHUTDOWN
from service.turns import TurnDone, TurnEvent

T = TypeVar("T")
log = logging.getLogger("turnstore.api")

SHUTTING_DOWN = "The server is shutting down; the stream ended before the turn completed. Retry."


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


def _event(name: str, data: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=name, data=msgspec.json.encode(data).decode())


async def sse_events(
    events: AsyncGenerator[TurnEvent, None], correlation_id: str, keepalive_s: float
) -> AsyncGenerator[ServerSentEventMessage, None]:
    OPEN_STREAMS.inc()
    try:
        async with aclosing(with_keepalive(events, keepalive_s, SHUTDOWN.wait)) as items:
            async for event in items:
                if event is None:
                    yield ServerSentEventMessage(comment="keep-alive")
                elif isinstance(event, TextDelta):
                    yield _event("message.delta", {"delta": event.text})
                elif isinstance(event, ToolCalled):
                    yield _event("tool.call", {"name": event.name, "status": event.status})
                elif isinstance(event, TurnDone):
                    yield _event("message.done", MessageDone.of(event))
                    return  # the terminal event: a shutdown now must not add another
    except Stopped:
        log.info("stream ended: shutting down", extra={"correlation_id": correlation_id})
        yield _event("error", envelope("not_ready", SHUTTING_DOWN, correlation_id))
    except TurnstoreError as exc:
        if exc.status >= 500:  # logged as the JSON endpoints log it (service/api/errors.py)
            cause = type(exc.__cause__).__name__ if exc.__cause__ else "-"
            state = getattr(exc, "sqlstate", None)
            log.warning(
                "%s: %s sqlstate=%s",
                exc.code,
                cause,
                state,
                extra={"correlation_id": correlation_id},
            )
        yield _event("error", envelope(exc.code, exc.message, correlation_id))
    except Exception:
        log.exception("stream failed", extra={"correlation_id": correlation_id})
        yield _event("error", envelope("internal_error", "Internal error.", correlation_id))
    finally:
        OPEN_STREAMS.dec()


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
