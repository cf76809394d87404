"""Rows in and out: the store's values as columns and back, in clear or sealed.

A ``Rows`` is bound to one conversation and to the data key its values are sealed or opened
with (None: in clear), so whether a value is sealed is decided once, where the key is chosen
(sealed.writing_key for what is written, ``reading`` for rows read back), not by every
function that touches a column. ``Events`` is the same for a run's event batches. Rows read
back are asyncpg Records."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from uuid import UUID

import msgspec

from service.core.events import RunEvent
from service.core.model import (
    Conversation,
    ConversationInfo,
    Origin,
    ToolCallRecord,
    TranscriptTurn,
    Turn,
)
from service.core.sizes import TurnSizes
from service.core.usage import Usage
from service.platform.crypto import DataKey
from service.store.postgres.keyring import Keyring
from service.store.postgres.sealed import (
    TURN_FIELDS,
    check_row,
    events_place,
    get,
    metadata_place,
    put,
    reading_key,
    sealed_turn_columns,
    turn_place,
)

Row = Any  # an asyncpg Record, or a mapping with the same columns

_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_CALLS = msgspec.json.Decoder(list[ToolCallRecord])
_METADATA = msgspec.json.Decoder(dict[str, str])
_BATCH = msgspec.json.Decoder(list[tuple[int, str, msgspec.Raw]])
_JSON = msgspec.json.Encoder()
_TRANSCRIPT = ("user_message", "assistant_message", "tool_calls", "transcript")
_SAID = msgspec.json.Decoder(tuple[tuple[str, str], ...])
_USAGE = msgspec.json.Decoder(Usage)
_REQUIRED = ("user_message", "assistant_message", "replay_items")


@dataclass(frozen=True, slots=True)
class Rows:
    """One conversation's rows, sealed or opened with ``key`` (None: in clear)."""

    key: DataKey | None
    conversation_id: UUID

    def turn(self, row: Row) -> Turn:
        """A turn read with statements.TURN."""
        check_row(row, TURN_FIELDS, _REQUIRED, partial(self._place, row, "*"))
        calls = self._field(row, "tool_calls")
        return Turn(
            user_message=self._field(row, "user_message"),
            assistant_message=self._field(row, "assistant_message"),
            replay_items=_ITEMS.decode(self._field(row, "replay_items")),
            origin=_origin(row),
            context_from=row["context_from"] or 1,
            prompt_version=row["prompt_version"],
            tool_calls=_CALLS.decode(calls) if calls else (),
            status=row["status"],
            incomplete_reason=row["incomplete_reason"],
            created_at=row["turn_created_at"],
            usage=_usage(row),
            transcript=self._said(row),
            response=_raw(self._field(row, "response")),
            compacted=_compacted(self._field(row, "compacted")),
            response_deleted=bool(row["response_deleted"]),
            turn_id=row["turn_id"],
            number=row["seq"],
        )

    def transcript_turn(self, row: Row) -> TranscriptTurn:
        """A turn as people read it, from statements.PAGE_ROWS."""
        check_row(row, _TRANSCRIPT, _REQUIRED[:2], partial(self._place, row, "*"))
        calls = self._field(row, "tool_calls")
        return TranscriptTurn(
            number=row["seq"],
            user_message=self._field(row, "user_message"),
            assistant_message=self._field(row, "assistant_message"),
            context_from=row["context_from"] or 1,
            prompt_version=row["prompt_version"],
            tool_calls=_CALLS.decode(calls) if calls else (),
            said=self._said(row),
            usage=_usage(row),
            model=row["model"],
        )

    def turn_columns(self, seq: int, turn: Turn, turn_id: UUID | None) -> dict[str, Any]:
        """The columns of ``turn`` as turn ``seq`` (statements.TURN_VALUES and its place)."""
        encrypted = {
            "user_message": turn.user_message,
            "assistant_message": turn.assistant_message,
            "replay_items": msgspec.json.encode(turn.replay_items).decode(),
            "tool_calls": msgspec.json.encode(turn.tool_calls).decode()
            if turn.tool_calls
            else None,
            "transcript": _JSON.encode(turn.transcript).decode()
            if turn.transcript is not None
            else None,
            "response": bytes(turn.response).decode() if turn.response else None,
            "compacted": msgspec.json.encode(turn.compacted).decode() if turn.compacted else None,
        }
        origin, sizes = turn.origin, TurnSizes.of(turn)
        return {
            "turn_id": turn_id,
            "conversation_id": self.conversation_id,
            "seq": seq,
            **sealed_turn_columns(self.key, self.conversation_id, seq, encrypted),
            "provider": origin.provider if origin else None,
            "endpoint": origin.endpoint if origin else None,
            "model": origin.model if origin else None,
            "kind": origin.kind if origin else None,
            "key_fingerprint": origin.key_fingerprint if origin else None,
            "context_from": turn.context_from,
            "prompt_version": turn.prompt_version,
            "status": turn.status,
            "incomplete_reason": turn.incomplete_reason,
            "usage": _JSON.encode(turn.usage).decode() if turn.usage else None,
            "items_bytes": sizes.items,
            "opaque_bytes": sizes.opaque,
            "turn_bytes": sizes.stored,
        }

    def metadata_columns(self, metadata: dict[str, str]) -> dict[str, Any]:
        clear, sealed = put(self.key, self._metadata, _JSON.encode(metadata).decode())
        return {"metadata": clear, "sealed_metadata": sealed}

    def metadata(self, row: Row) -> dict[str, str]:
        text = get(self.key, self._metadata, row["metadata"], row["sealed_metadata"])
        return _METADATA.decode(text) if text else {}

    def info(self, row: Row) -> ConversationInfo:
        """The conversation without its turns, from statements.INFO."""
        return ConversationInfo(
            id=row["id"],
            revision=row["revision"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            metadata=self.metadata(row),
            stored_response=row["expires_at"] is not None,
            stored_bytes=row["stored_bytes"],
            stored_revision=row["stored_revision"],
            rewritten_at=row["rewritten_at"],
        )

    def conversation(self, row: Row, turns: list[Turn], first: int = 1) -> Conversation:
        """The conversation of a row read with statements.HEAD (and maybe its rewritten_at),
        holding ``turns``: its turns from revision ``first`` on."""
        return Conversation(
            id=self.conversation_id,
            revision=row["revision"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            turns=turns,
            context_start=row["context_start"],
            owner=row["owner"],
            rewritten_at=row.get("rewritten_at", 0),
            stored_bytes=row["stored_bytes"],
            stored_revision=row["stored_revision"],
            first=first,
        )

    @property
    def _metadata(self) -> bytes:
        return metadata_place(self.conversation_id)

    def _place(self, row: Row, name: str) -> bytes:
        return turn_place(self.conversation_id, row["seq"], name)

    def _said(self, row: Row) -> tuple[tuple[str, str], ...] | None:
        text = self._field(row, "transcript")
        return _SAID.decode(text) if text else None

    def _field(self, row: Row, name: str) -> Any:
        """A turn's field from its clear and sealed columns."""
        sealed = row[f"sealed_{name}"]
        if sealed is None:  # in clear (no place to open it for)
            return row[name]
        return get(self.key, self._place(row, name), row[name], sealed)


@dataclass(frozen=True, slots=True)
class Events:
    """One run's event batches, sealed or opened with ``key`` (None: in clear)."""

    key: DataKey | None
    run_id: UUID

    def batch_columns(self, events: Sequence[RunEvent]) -> dict[str, Any]:
        """A batch's columns (named by its last event's number)."""
        text = "[" + ",".join(f'[{e.seq},"{e.name}",{e.data}]' for e in events) + "]"
        clear, sealed = put(self.key, events_place(self.run_id, events[-1].seq), text)
        return {"events": clear, "sealed_events": sealed}

    def after(self, rows: Iterable[Row], after: int) -> list[RunEvent]:
        """The events after ``after`` in these batches, each once (a batch logged twice, its
        first try's outcome unknown, may overlap the next)."""
        found: dict[int, RunEvent] = {}
        for row in rows:
            if row["seq"] is None:
                continue
            where = events_place(self.run_id, row["seq"])
            text = get(self.key, where, row["events"], row["sealed_events"])
            for seq, name, data in _BATCH.decode(text):
                if seq > after:
                    found.setdefault(seq, RunEvent(seq, name, bytes(data).decode()))
        return [found[seq] for seq in sorted(found)]


def _usage(row: Row) -> Usage | None:
    text = row["usage"]
    return _USAGE.decode(text) if text else None


def _compacted(text: str | None) -> tuple[msgspec.Raw, ...]:
    return tuple(_ITEMS.decode(text)) if text else ()


def _raw(text: str | None) -> msgspec.Raw | None:
    return msgspec.Raw(text.encode()) if text else None


async def reading(
    keyring: Keyring | None,
    owner: str,
    conversation_id: UUID,
    rows: Iterable[Row],
    names: Iterable[str] = TURN_FIELDS,
) -> Rows:
    """The rows of these (read back): with the owner's key if any of them holds a sealed field
    of ``names`` (rows in clear need no keyring)."""
    return Rows(await reading_key(keyring, owner, rows, names), conversation_id)


def _origin(row: Row) -> Origin | None:
    """Where a turn's items came from (None: a turn stored before origins were kept)."""
    if not row["provider"]:
        return None
    kind, key = row["kind"], row["key_fingerprint"]
    return Origin(row["provider"], row["endpoint"], row["model"], kind, key)
