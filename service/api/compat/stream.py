"""A response's events as OpenAI's Responses stream, in OpenAI's order: ``response.created``,
``response.in_progress``, each output item's ``output_item.added`` ... ``.done`` at its place
in the final ``output`` (reasoning first, as the provider finishes it; the message's
``content_part.added`` before its deltas), one response id throughout, ``response.completed``
(or ``response.incomplete``) only after the commit, with the whole output; or one ``error``
event for a turn that commits nothing. SSE ``id:`` lines are not sent: with keep-alive comments
they break the Python SDK's parser. turnstore's own tool calls stay inside the turn.

A response that runs as a run (service/core/events.py) is rendered from its run's events and
what the run and its committed turn recorded, never from this process's memory alone: every
replay, on any replica, carries the same events with the same ``sequence_number``s, and one
resumed ``starting_after`` N gets those after N. A ``store: false`` stream is rendered from
the provider's events as they come (``relayed``): nothing of it is kept, so nothing resumes.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from service.api.compat.item_views import output_items
from service.api.compat.objects import response_object
from service.api.errors import openai_type
from service.core import events
from service.core.asks import Echo
from service.core.errors import ContentFiltered, TurnstoreError, status_of
from service.core.events import RunEvent
from service.core.ids import Ids, unstored_id
from service.core.items import compaction_item, input_count, shown_id
from service.core.model import Turn
from service.core.usage import Usage
from service.providers.base import ItemDone, ProviderEvent, Reply, TextDelta
from service.usecases.turns import TurnDone

_JSON = msgspec.json.Encoder()


class _Delta(msgspec.Struct):
    delta: str


class _Item(msgspec.Struct):
    item: dict[str, Any]


class _Done(msgspec.Struct):
    status: str
    incomplete_reason: str | None
    revision: int | None


class _Error(msgspec.Struct):
    code: str
    message: str


class _Failed(msgspec.Struct):
    error: _Error


@dataclass(frozen=True)
class Output:
    """A committed response's output: its turn's items after its inputs (after the
    compaction item it ran on, if it compacted), and its usage."""

    items: Sequence[msgspec.Raw]
    first: int  # how many input items precede them in the turn
    own_calls: Collection[str]  # turnstore's own tools' calls among them (not shown)
    usage: Usage | None
    compaction: msgspec.Raw | None = None
    committed_at: datetime | None = None  # (None: just now)

    @classmethod
    def of_turn(cls, turn: Turn) -> Output:
        first = input_count(turn.replay_items)
        own = {call.call_id for call in turn.tool_calls}
        compaction = compaction_item(turn.compacted)
        return cls(turn.replay_items[first:], first, own, turn.usage, compaction, turn.created_at)

    @classmethod
    def of_done(cls, done: TurnDone) -> Output:
        return cls(done.items, done.inputs, done.own_calls, done.usage, done.compaction)

    def shown(
        self, ids: Ids, cid: uuid.UUID | None, revision: int, encrypted: bool
    ) -> list[dict[str, Any]]:
        return output_items(
            ids,
            cid,
            revision,
            self.items,
            self.first,
            encrypted=encrypted,
            own_calls=self.own_calls,
            compaction=self.compaction,
        )


@dataclass(frozen=True)
class Source:
    """What only the store (or this process, for its own run) knows of a streamed response:
    the provider's id of the message it streams, the revision its turn makes (once it holds
    its conversation), and the output it committed."""

    message_id: Callable[[], Awaitable[str | None]]
    output: Callable[[int], Awaitable[Output]]  # of the turn that made this revision
    revision: Callable[[], Awaitable[int | None]]


class ResponseStream:
    """Numbers the events of one response and builds them. Every output item is announced
    (``output_item.added`` ... ``.done``) at the ``output_index`` it has in the final
    ``output``: reasoning as the provider finishes it, the message as its text starts, and what
    was not streamed (function calls, ...) whole at the end."""

    def __init__(
        self,
        response_id: str,
        cid: uuid.UUID | None,
        echo: Echo,
        *,
        ids: Ids,
        source: Source | None = None,
        starting_after: int | None = None,
        encrypted: bool = False,
    ) -> None:
        self.response_id, self.cid, self.echo, self.ids = response_id, cid, echo, ids
        self.encrypted = encrypted  # its output shows sealed reasoning
        self.source = source
        self.starting_after = starting_after if starting_after is not None else -1
        self.sequence = 0
        self.index = 0  # the output_index of the next item announced
        self.announced: set[str] = set()  # the ids of the items announced so far
        self.message_id: str | None = None
        self.message_index = 0
        self.revision: int | None = None  # the one its turn makes, once known
        self.text: list[str] = []

    def started(self) -> list[ServerSentEventMessage]:
        first = "queued" if self.echo.background else "in_progress"
        return self._shown(
            [
                self._event("response.created", response=self._response(first)),
                self._event("response.in_progress", response=self._response("in_progress")),
            ]
        )

    async def render(self, event: RunEvent) -> list[ServerSentEventMessage]:
        """A run's event (tool.call: turnstore's own tools stay inside the turn)."""
        if event.name == events.ITEM_DONE:
            item = msgspec.json.decode(event.data, type=_Item).item
            item["id"] = await self._shown_id(item.get("id"), item.get("type"))
            return self._shown(self._item(item))
        if event.name == events.DELTA:
            text = msgspec.json.decode(event.data, type=_Delta).delta
            if self.message_id is None and self.source is not None:
                self.message_id = await self._shown_id(await self.source.message_id(), "message")
            return self._shown(self._delta(text))
        if event.name == events.DONE:
            done = msgspec.json.decode(event.data, type=_Done)
            if done.revision is None:
                return self._shown([self.error(ContentFiltered())])
            assert self.source is not None
            output = await self.source.output(done.revision)
            finished = self._finished(
                done.status,
                done.incomplete_reason,
                output,
                done.revision,
                encrypted=self.encrypted,
            )
            return self._shown(finished)
        if event.name == events.ERROR:
            failed = msgspec.json.decode(event.data, type=_Failed).error
            status = status_of(failed.code)
            return self._shown([self._error(failed.code, failed.message, None, status)])
        return []

    def ends(self, event: RunEvent) -> bool:
        return event.terminal

    def relayed(self, event: ProviderEvent) -> list[ServerSentEventMessage]:
        """A ``store: false`` stream's provider event (its items under the provider's ids,
        whole: nothing of them is kept anywhere else)."""
        if isinstance(event, ItemDone):
            return self._item(output_items(self.ids, None, 0, [event.item], 0, encrypted=True)[0])
        if isinstance(event, TextDelta):
            self.message_id = self.message_id or event.item_id
            return self._delta(event.text)
        if event.incomplete_reason == "content_filter":
            return [self.error(ContentFiltered())]
        output = Output(event.output_items, 0, (), event.usage)
        return self._finished(event.status, event.incomplete_reason, output, 0, encrypted=True)

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage:
        return self._error(exc.code, exc.message, exc.param, exc.status)

    def _item(self, item: dict[str, Any]) -> list[ServerSentEventMessage]:
        """An item the provider finished before the text: announced whole, at its place."""
        index, self.index = self.index, self.index + 1
        self.announced.add(item["id"])
        if item.get("type") == "compaction":  # its sealed content is the final output's only
            item = {**item, "encrypted_content": item.get("encrypted_content", "")}
            added = item
        else:
            added = {key: value for key, value in item.items() if key != "encrypted_content"}
        if added.get("type") == "reasoning":
            added["summary"] = []  # as OpenAI's .added copy: its summary comes with .done
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _delta(self, text: str) -> list[ServerSentEventMessage]:
        opened = []
        if not self.text:
            self.message_id = self.message_id or unstored_id("msg")
            self.message_index, self.index = self.index, self.index + 1
            self.announced.add(self.message_id)
            item = self._message("in_progress", [])
            opened = [
                self._event(
                    "response.output_item.added", output_index=self.message_index, item=item
                ),
                self._event("response.content_part.added", **self._at(), part=_part("")),
            ]
        self.text.append(text)
        return [
            *opened,
            self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[]),
        ]

    def _finished(
        self,
        status: str,
        reason: str | None,
        output: Output,
        revision: int,
        *,
        encrypted: bool = False,
    ) -> list[ServerSentEventMessage]:
        out = []
        if self.text:
            text, at = "".join(self.text), self.message_index
            out = [
                self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._at(), part=_part(text)),
                self._event(
                    "response.output_item.done",
                    output_index=at,
                    item=self._message("completed", [_part(text)]),
                ),
            ]
        shown = output.shown(self.ids, self.cid, revision, encrypted)
        for index, item in enumerate(shown):  # what was not streamed: announced whole
            if item["id"] not in self.announced and item["type"] != "message":
                out += [
                    self._event("response.output_item.added", output_index=index, item=item),
                    self._event("response.output_item.done", output_index=index, item=item),
                ]
        final = self._response(
            status,
            output=shown,
            incomplete_reason=reason,
            usage=output.usage,
            completed_at=output.committed_at,
        )
        return [*out, self._event(f"response.{status}", response=final)]

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

    def _shown(self, messages: list[ServerSentEventMessage]) -> list[ServerSentEventMessage]:
        """Those after ``starting_after`` (a resumed stream); numbered like the others."""
        if self.starting_after < 0:
            return messages
        first = self.sequence - len(messages)  # the number of the first of them
        return [m for n, m in enumerate(messages, start=first) if n > self.starting_after]

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(self.cid, self.echo, rid=self.response_id, status=status, **fields)

    async def _shown_id(self, provider_id: str | None, kind: str | None) -> str | None:
        """The id an item of the provider's is shown by (service/core/ids.py): the one its
        turn will list it by."""
        if provider_id is None or self.cid is None or self.source is None:
            return provider_id
        self.revision = self.revision or await self.source.revision()  # read once
        if self.revision is None:
            return None
        return shown_id(self.ids, self.cid, self.revision, 0, provider_id, kind)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self.message_index, "content_index": 0}

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class Relayed:
    """The rendering of a ``store: false`` stream: the provider's events, as they come."""

    def __init__(self, stream: ResponseStream) -> None:
        self._stream = stream

    def started(self) -> list[ServerSentEventMessage]:
        return self._stream.started()

    async def render(self, event: ProviderEvent) -> list[ServerSentEventMessage]:
        return self._stream.relayed(event)

    def ends(self, event: ProviderEvent) -> bool:
        return isinstance(event, Reply)

    def error(self, exc: TurnstoreError) -> ServerSentEventMessage:
        return self._stream.error(exc)
