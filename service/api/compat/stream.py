"""A run's events (service/core/events.py) as OpenAI's Responses stream, in the order the SDK's
``responses.stream()`` helper demands: ``response.created`` first, the message's
``output_item.added`` and ``content_part.added`` before its deltas, one response id
throughout, ``response.completed`` (or ``response.incomplete``) only after the commit, with
the whole output; or one ``error`` event for a turn that commits nothing. SSE ``id:`` lines
are not sent: the SDK's parser trips over them. turnstore's own tool calls stay inside the
turn, unannounced.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from service.api.compat.items import output_items
from service.api.compat.schemas import Echo, response_object
from service.api.errors import openai_type
from service.core import events
from service.core.errors import ContentFiltered, TurnstoreError, status_of
from service.core.events import RunEvent
from service.core.ids import view_item_id
from service.usecases.run import Run

_JSON = msgspec.json.Encoder()


class _Delta(msgspec.Struct):
    delta: str


class _Done(msgspec.Struct):
    status: str
    incomplete_reason: str | None
    revision: int | None


class _Error(msgspec.Struct):
    code: str
    message: str


class _Failed(msgspec.Struct):
    error: _Error


class ResponseStream:
    """Numbers the events of one response and builds them from its run's events."""

    def __init__(
        self, run: Run, cid: uuid.UUID, revision: int, echo: Echo, created_at: float
    ) -> None:
        self.run, self.cid, self.revision, self.echo = run, cid, revision, echo
        self.created_at = created_at
        self.sequence = 0
        self.message_id: str | None = None
        self.text: list[str] = []

    def started(self) -> list[ServerSentEventMessage]:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def render(self, event: RunEvent) -> list[ServerSentEventMessage]:
        if event.name == events.DELTA:
            return self._delta(msgspec.json.decode(event.data, type=_Delta).delta)
        if event.name == events.DONE:
            return self._done(msgspec.json.decode(event.data, type=_Done))
        if event.name == events.ERROR:
            failed = msgspec.json.decode(event.data, type=_Failed).error
            return [self._error(failed.code, failed.message, None, status_of(failed.code))]
        return []  # tool.call: turnstore's own tools stay inside the turn

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage:
        return self._error(exc.code, exc.message, exc.param, exc.status)

    def _delta(self, text: str) -> list[ServerSentEventMessage]:
        opened = []
        if self.message_id is None:
            self.message_id = self.run.message_id or view_item_id(self.cid, self.revision, 0)
            item = self._message("in_progress", [])
            opened = [
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._at(), part=_part("")),
            ]
        self.text.append(text)
        return [*opened, self._event("response.output_text.delta", **self._at(), delta=text,
                                     logprobs=[])]  # fmt: skip

    def _done(self, done: _Done) -> list[ServerSentEventMessage]:
        if done.revision is None:
            return [self.error(ContentFiltered())]
        out = []
        if self.message_id is not None:
            text = "".join(self.text)
            out = [
                self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._at(), part=_part(text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._message("completed", [_part(text)])),
            ]  # fmt: skip
        result = self.run.result
        committed = result.items if result is not None else ()
        inputs = result.inputs if result is not None else 0
        own = result.own_calls if result is not None else frozenset()
        output = output_items(self.cid, done.revision, committed, inputs, own_calls=own)
        index = 0 if self.message_id is None else 1
        for item in output:  # the client's function calls, to run: announced whole
            if item["type"] == "function_call":
                out += [
                    self._event("response.output_item.added", output_index=index, item=item),
                    self._event("response.output_item.done", output_index=index, item=item),
                ]
                index += 1
        reason, usage = done.incomplete_reason, result.usage if result is not None else None
        final = self._response(done.status, output=output, incomplete_reason=reason, usage=usage)
        return [*out, self._event(f"response.{done.status}", response=final)]

    def _error(
        self, code: str, message: str, param: str | None, status: int
    ) -> ServerSentEventMessage:
        """OpenAI's ``error`` event, with the nested ``error`` object as well: the Python
        SDK raises on that, the JavaScript SDK on the event type."""
        fields = {"code": code, "message": message, "param": param}
        return self._event("error", **fields, error={"type": openai_type(status), **fields})

    def _event(self, kind: str, **fields: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerSentEventMessage(event=kind, data=_JSON.encode(data).decode())

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(
            self.cid, self.revision, self.echo, status=status, created_at=self.created_at,
            **fields,
        )  # fmt: skip

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}  # fmt: skip


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
