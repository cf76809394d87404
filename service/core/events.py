"""The events a turn's client sees, as a run numbers and logs them: their names and payloads,
in one place (service/usecases/runs.py publishes them, the stores log them, the SSE layer
sends them, ``/v1`` renders them as a Response stream).

    message.delta  {"delta": "<text>"}
    tool.call      {"name": "<tool>", "status": "<status>"}
    item.done      {"item": <a reasoning or compaction item, without its encrypted_content>}
                   (/v1 turns only: its stream announces it before the message after it)
    message.done   {"status", "incomplete_reason", "conversation_id", "revision", "turn_id",
                    "usage"}
    error          {"error": {"code", "message", "correlation_id"}}

Exactly one terminal event (``message.done`` or ``error``) ends a run's events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

import msgspec

from service.core.errors import TurnInterrupted, TurnstoreError, envelope
from service.core.usage import Usage

DELTA = "message.delta"
TOOL_CALL = "tool.call"
ITEM_DONE = "item.done"
DONE = "message.done"
ERROR = "error"
TERMINAL = frozenset({DONE, ERROR})

# The messages of the two ways a run ends without its client or its replica.
INTERRUPTED = TurnInterrupted.default_message
GONE = "The client went away before the turn committed; nothing was kept."

_JSON = msgspec.json.Encoder()


@dataclass(frozen=True)
class RunEvent:
    """One event of a run, as its client saw it: its number (the SSE ``id``), its name and
    its JSON data."""

    seq: int
    name: str
    data: str

    @property
    def terminal(self) -> bool:
        return self.name in TERMINAL


def _event(seq: int, name: str, data: dict[str, Any]) -> RunEvent:
    return RunEvent(seq, name, _JSON.encode(data).decode())


def delta(seq: int, text: str) -> RunEvent:
    return _event(seq, DELTA, {"delta": text})


def tool_call(seq: int, name: str, status: str) -> RunEvent:
    return _event(seq, TOOL_CALL, {"name": name, "status": status})


def item_done(seq: int, item: dict[str, Any]) -> RunEvent:
    """An output item finished before the text, as its client sees it: never its sealed
    content (events hold what a client saw)."""
    return _event(
        seq, ITEM_DONE, {"item": {k: v for k, v in item.items() if k != "encrypted_content"}}
    )


def error(seq: int, code: str, message: str, correlation_id: str) -> RunEvent:
    return _event(seq, ERROR, envelope(code, message, correlation_id))


def failure(seq: int, exc: TurnstoreError, correlation_id: str) -> RunEvent:
    return error(seq, exc.code, exc.message, correlation_id)


@dataclass(frozen=True)
class Done:
    """A run's ``message.done``, all but its number and the revision its commit makes (None:
    nothing was committed, as for the content filter)."""

    status: str
    incomplete_reason: str | None
    conversation_id: UUID
    turn_id: UUID
    usage: Usage | None = None

    def event(self, seq: int, revision: int | None) -> RunEvent:
        return _event(
            seq,
            DONE,
            {
                "status": self.status,
                "incomplete_reason": self.incomplete_reason,
                "conversation_id": str(self.conversation_id),
                "revision": revision,
                "turn_id": str(self.turn_id),
                "usage": self.usage.as_openai() if self.usage is not None else None,
            },
        )
