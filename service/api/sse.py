"""Turn events as Server-Sent Events, with keep-alive comments during long silences.

A client disconnect cancels this generator; its ``finally`` then closes the turn's event
iterator, which cancels the provider call and releases the conversation lock. Exactly one
terminal event (``message.done`` or ``error``) ends a stream that runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

import anyio
import msgspec
from litestar.response import ServerSentEventMessage

from service.api.errors import envelope
from service.errors import TurnstoreError
from service.providers.base import TextDelta
from service.turns import TurnDone, TurnEvent

T = TypeVar("T")
log = logging.getLogger("turnstore.api")


def _event(name: str, data: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=name, data=msgspec.json.encode(data).decode())


async def sse_events(
    events: AsyncGenerator[TurnEvent, None], correlation_id: str, keepalive_s: float
) -> AsyncIterator[ServerSentEventMessage]:
    try:
        async for event in with_keepalive(events, keepalive_s):
            if event is None:
                yield ServerSentEventMessage(comment="keep-alive")
            elif isinstance(event, TextDelta):
                yield _event("message.delta", {"delta": event.text})
            elif isinstance(event, TurnDone):
                yield _event("message.done", _done_data(event))
    except TurnstoreError as exc:
        yield _event("error", envelope(exc.code, exc.message, correlation_id))
    except Exception:
        log.exception("stream failed", extra={"correlation_id": correlation_id})
        yield _event("error", envelope("internal_error", "Internal error.", correlation_id))


def _done_data(done: TurnDone) -> dict[str, Any]:
    return {
        "status": done.status,
        "incomplete_reason": done.incomplete_reason,
        "conversation_id": str(done.conversation_id),
        "revision": done.revision,
    }


async def with_keepalive(
    source: AsyncGenerator[T, None], interval_s: float
) -> AsyncIterator[T | None]:
    """Items of ``source``, with None whenever it stays silent for ``interval_s``.

    The pending ``__anext__`` runs as a task that a timeout does not cancel, so a slow
    source is never interrupted by a keep-alive.
    """
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
            await source.aclose()
