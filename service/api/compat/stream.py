"""A turn's events as OpenAI's Responses stream, in the order the SDK's ``responses.stream()``
helper demands: ``response.created`` first, the message's ``output_item.added`` and
``content_part.added`` before its deltas, one response id throughout, ``response.completed``
(or ``response.incomplete``) only after the commit, with the whole output; or one ``error``
event for a turn that commits nothing. SSE ``id:`` lines are not sent: the SDK's parser
trips over them."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from service.api.compat.ids import view_item_id
from service.api.compat.items import output_items
from service.api.compat.schemas import response_object
from service.api.errors import log_failure, openai_type
from service.api.sse import Stopped, with_keepalive
from service.core.errors import ContentFiltered, NotReady, TurnstoreError
from service.platform.shutdown import SHUTDOWN
from service.providers.base import TextDelta
from service.usecases.turns import TurnDone, TurnEvent, TurnStarted

log = logging.getLogger("turnstore.api")
_JSON = msgspec.json.Encoder()
SHUTTING_DOWN = "This replica is shutting down; nothing of the turn was kept. Retry."


class ResponseStream:
    """Numbers the events of one response and builds them."""

    def __init__(self, cid: uuid.UUID, revision: int, model: str, truncation: str | None) -> None:
        self.cid, self.revision, self.model, self.truncation = cid, revision, model, truncation
        self.created_at = time.time()
        self.sequence = 0
        self.message_id: str | None = None
        self.text: list[str] = []

    def event(self, kind: str, **fields: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerSentEventMessage(event=kind, data=_JSON.encode(data).decode())

    def response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.cid, self.revision, model=self.model, status=status,
            created_at=self.created_at, truncation=self.truncation, **fields,
        )  # fmt: skip

    def started(self) -> list[ServerSentEventMessage]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def delta(self, delta: TextDelta) -> list[ServerSentEventMessage]:
        opened = []
        if self.message_id is None:
            self.message_id = delta.item_id or view_item_id(self.cid, self.revision, 0)
            item = self._message("in_progress", [])
            opened = [
                self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", **self._at(), part=self._part("")),
            ]
        self.text.append(delta.text)
        return [*opened, self.event("response.output_text.delta", **self._at(), delta=delta.text,
                                    logprobs=[])]  # fmt: skip

    def done(self, done: TurnDone) -> list[ServerSentEventMessage]:
        if done.revision is None:
            return [self.error(ContentFiltered())]
        out = []
        if self.message_id is not None:
            text = "".join(self.text)
            out = [
                self.event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self.event("response.content_part.done", **self._at(), part=self._part(text)),
                self.event("response.output_item.done", output_index=0,
                           item=self._message("completed", [self._part(text)])),
            ]  # fmt: skip
        output = output_items(self.cid, done.revision, done.items, done.inputs)
        index = 0 if self.message_id is None else 1
        for item in output:  # the client's function calls, to run: announced whole
            if item["type"] == "function_call":
                out += [
                    self.event("response.output_item.added", output_index=index, item=item),
                    self.event("response.output_item.done", output_index=index, item=item),
                ]
                index += 1
        reason = done.incomplete_reason
        final = self.response(done.status, output=output, incomplete_reason=reason)
        return [*out, self.event(f"response.{done.status}", response=final)]

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage:
        """OpenAI's ``error`` event, with the nested ``error`` object as well: the Python
        SDK raises on that, the JavaScript SDK on the event type."""
        fields = {"code": exc.code, "message": exc.message, "param": exc.param}
        return self.event("error", **fields, error={"type": openai_type(exc.status), **fields})

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}  # fmt: skip

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}


async def first_event(
    events: AsyncGenerator[TurnEvent, None],
) -> TurnStarted | TurnDone:
    """The turn's first event: it holds its conversation (or an Idempotency-Key retry has
    its answer). Whatever fails before it is an ordinary JSON error."""
    try:
        event = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    assert isinstance(event, TurnStarted | TurnDone)
    return event


async def response_events(
    first: TurnStarted | TurnDone,
    events: AsyncGenerator[TurnEvent, None],
    *,
    model: str,
    truncation: str | None,
    keepalive_s: float,
    correlation_id: str,
) -> AsyncGenerator[ServerSentEventMessage, None]:
    revision = first.revision if isinstance(first, TurnDone) else first.revision + 1
    stream = ResponseStream(first.conversation_id, revision or 0, model, truncation)
    for message in stream.started():
        yield message
    try:
        if isinstance(first, TurnDone):  # an Idempotency-Key retry: the committed answer
            for message in stream.delta(TextDelta(first.message)) + stream.done(first):
                yield message
            return
        async with aclosing(with_keepalive(events, keepalive_s, SHUTDOWN.wait)) as items:
            async for event in items:
                if event is None:
                    yield ServerSentEventMessage(comment="keep-alive")
                elif isinstance(event, TextDelta):
                    for message in stream.delta(event):
                        yield message
                elif isinstance(event, TurnDone):
                    for message in stream.done(event):
                        yield message
                    return
                # ToolCalled: turnstore's own tools stay inside the turn, unannounced.
    except Stopped:  # the turn is cancelled (nothing kept): the client retries elsewhere
        yield stream.error(NotReady(SHUTTING_DOWN))
    except TurnstoreError as exc:
        if exc.status >= 500:
            log_failure(exc, correlation_id)
        yield stream.error(exc)
    except Exception:
        log.exception("stream failed", extra={"correlation_id": correlation_id})
        yield stream.error(TurnstoreError())
    finally:
        await events.aclose()
