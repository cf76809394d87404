"""A conversation as ndjson, out and in (GET .../export, POST .../import, `turnstore owners
export`): a first line with the conversation, then one line per committed turn in order, with
its replay items byte for byte and its origin, so that an import makes the same conversation
whose next turn on the same provider replays them as if they had never moved.

An import is read a line at a time (``Importing.add``): each line is checked as it comes (a
malformed line, an unknown field, a revision out of order: InvalidInput naming the line)
and nothing is written before the last one was (``Importing.done``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import msgspec

from service.core.errors import InvalidInput
from service.core.model import (
    ConversationInfo,
    Origin,
    ToolCallRecord,
    Turn,
    check_metadata,
    plain,
)
from service.core.sizes import turn_bytes
from service.core.translate import readable_item
from service.core.usage import Usage


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class ConversationLine(msgspec.Struct, forbid_unknown_fields=True):
    """The first line."""

    id: str
    metadata: dict[str, str]
    created_at: datetime
    updated_at: datetime
    revision: int
    window_start: int
    forked_from: str | None = None
    object: Literal["conversation"] = "conversation"


class OriginLine(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A turn's origin (core/model.py's Origin, field for field)."""

    provider: str
    endpoint: str
    model: str
    kind: str | None = None
    key_fingerprint: str | None = None


class TurnLine(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One committed turn: ``messages`` as people read them, ``replay_items`` (and
    ``compacted``, the compacted context it ran on) as the provider defined them, byte for
    byte; ``origin`` what made them (every field Origin has). ``user_message`` and
    ``assistant_message`` (what /api/v1 shows of a turn of items) only where ``messages`` are
    not that pair."""

    revision: int
    created_at: datetime
    messages: list[Message]
    replay_items: list[msgspec.Raw]
    user_message: str | None = None
    assistant_message: str | None = None
    origin: OriginLine | None = None
    window_start: int = 1
    prompt_version: str | None = None
    usage: Usage | None = None
    tool_calls: list[ToolCallRecord] = []
    status: Literal["completed", "incomplete"] = "completed"
    incomplete_reason: str | None = None
    compacted: list[msgspec.Raw] = []
    response: msgspec.Raw | None = None
    response_deleted: bool = False
    object: Literal["turn"] = "turn"


_ENCODE = msgspec.json.Encoder()
_HEADER = msgspec.json.Decoder(ConversationLine)
_TURN = msgspec.json.Decoder(TurnLine)


def conversation_line(info: ConversationInfo) -> bytes:
    forked = str(info.forked_from) if info.forked_from else None
    line = ConversationLine(
        str(info.id),
        info.metadata,
        info.created_at,
        info.updated_at,
        info.revision,
        info.context_start,
        forked,
    )
    return _ENCODE.encode(line) + b"\n"


# What a turn line holds as the turn does, under the same name, both ways.
_AS_IS = ("prompt_version", "usage", "status", "incomplete_reason", "response_deleted")


def _as_is(source: object) -> dict[str, Any]:
    return {name: getattr(source, name) for name in _AS_IS}


def turn_line(revision: int, turn: Turn) -> bytes:
    said = turn.transcript or plain(turn.user_message, turn.assistant_message)
    line = TurnLine(
        revision=revision,
        created_at=turn.created_at or datetime.min,
        messages=[Message(role, text) for role, text in said],
        replay_items=list(turn.replay_items),
        user_message=turn.user_message if turn.transcript is not None else None,
        assistant_message=turn.assistant_message if turn.transcript is not None else None,
        origin=OriginLine(**dataclasses.asdict(turn.origin)) if turn.origin else None,
        window_start=turn.context_from,
        tool_calls=list(turn.tool_calls),
        compacted=list(turn.compacted),
        response=turn.response,
        **_as_is(turn),
    )
    return _ENCODE.encode(line) + b"\n"


@dataclass(frozen=True)
class Imported:
    """A conversation to make as it was exported: its metadata, revision, window start and
    turns (each with its revision as ``number`` and its ``created_at``)."""

    metadata: dict[str, str]
    revision: int
    context_start: int
    turns: Sequence[Turn]

    @property
    def size(self) -> int:
        """What it stores (service/core/sizes.py), metadata included."""
        pairs = sum(len(k) + len(v) for k, v in self.metadata.items())
        return pairs + sum(turn_bytes(turn) for turn in self.turns)


@dataclass
class Importing:
    """An import read a line at a time: ``add`` each line (numbered from 1), then ``done``."""

    header: ConversationLine | None = None
    turns: list[Turn] = field(default_factory=list)
    lines: int = 0

    def add(self, number: int, line: bytes) -> None:
        self.lines = number
        if not line.strip():
            raise _bad(number, "is empty")
        try:
            if self.header is None:
                self.header = _HEADER.decode(line)
                _check_header(number, self.header)
            else:
                self.turns.append(_turn(number, _TURN.decode(line), self._last, self.header))
        except msgspec.ValidationError as exc:
            raise _bad(number, f"is not valid: {exc}") from None
        except msgspec.DecodeError:
            raise _bad(number, "is not one JSON object") from None

    def done(self) -> Imported:
        header = self.header
        if header is None:
            raise InvalidInput("Line 1: the conversation line is missing.", param="line 1")
        if self._last != header.revision:
            raise _bad(
                self.lines,
                f"ends at revision {self._last}, the conversation line says {header.revision}",
            )
        return Imported(header.metadata, header.revision, header.window_start, self.turns)

    @property
    def _last(self) -> int:
        return self.turns[-1].number or 0 if self.turns else 0


def _bad(number: int, what: str) -> InvalidInput:
    return InvalidInput(f"Line {number} {what}; nothing was imported.", param=f"line {number}")


def _text(number: int, *values: str) -> None:
    if any("\x00" in value for value in values):
        raise _bad(number, "holds a NUL character")


def _check_header(number: int, header: ConversationLine) -> None:
    _text(number, *header.metadata, *header.metadata.values())
    try:
        check_metadata(header.metadata)
    except InvalidInput as refused:
        raise _bad(number, f"has metadata out of bounds ({refused.message})") from None
    if not 0 <= header.revision < 2**31 - 1 or not 1 <= header.window_start <= header.revision + 1:
        raise _bad(number, "has a revision or window start out of range")


def _turn(number: int, line: TurnLine, last: int, header: ConversationLine) -> Turn:
    if not last < line.revision <= header.revision:
        raise _bad(number, f"has revision {line.revision}, out of order (after {last})")
    if not 1 <= line.window_start <= line.revision:
        raise _bad(number, "has a window start that is not an earlier revision")
    said = tuple((m.role, m.content) for m in line.messages)
    user, assistant = line.user_message, line.assistant_message
    if user is None or assistant is None:  # a turn of a user message and its reply
        if user is not assistant or [role for role, _ in said] != ["user", "assistant"]:
            raise _bad(number, "has messages that are not a user message and its reply")
        (_, user), (_, assistant) = said
    _text(number, user, assistant, *(t for m in said for t in m))
    if any(not bytes(item).lstrip().startswith(b"{") for item in line.replay_items):
        raise _bad(number, "has a replay item that is not a JSON object")
    if not all(map(readable_item, line.replay_items)):  # a turn on it would fail for good
        raise _bad(number, "has a replay item its provider's form does not read")
    counts = dataclasses.astuple(line.usage) if line.usage is not None else ()
    if not all(0 <= count < 2**53 for count in counts):  # summed in bigint by GET /usage
        raise _bad(number, "has usage counts out of range")
    plain_pair = line.user_message is None
    return Turn(
        user_message=user,
        assistant_message=assistant,
        # Each item detached from the line it was read from (which it would keep in memory).
        replay_items=[item.copy() for item in line.replay_items],
        origin=_origin(line.origin),
        context_from=line.window_start,
        tool_calls=tuple(line.tool_calls),
        created_at=line.created_at,
        transcript=None if plain_pair else said,
        response=line.response.copy() if line.response is not None else None,
        compacted=tuple(item.copy() for item in line.compacted),
        number=line.revision,
        **_as_is(line),
    )


def _origin(origin: OriginLine | None) -> Origin | None:
    return Origin(**msgspec.structs.asdict(origin)) if origin is not None else None
