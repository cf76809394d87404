"""Values into rows and back: in clear, or sealed under the owner's data key.

Each encrypted field has its clear column and a ``sealed_`` one; a row sets one of the two.
With a data key (ENCRYPTION_KEYS_FILE set) values are written sealed; rows written in clear
before stay readable, and ``turnstore encrypt-existing`` rewrites them. A sealed value is
bound to its place (platform/crypto.py): the conversation and turn, or the run and event
batch, and the field.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from uuid import UUID

from service.core.errors import StorageError
from service.platform.crypto import UNREADABLE, DataKey, place
from service.store.postgres.keyring import Keyring

log = logging.getLogger("turnstore.crypto")

TURN_FIELDS = (
    "user_message",
    "assistant_message",
    "replay_items",
    "tool_calls",
    "transcript",
    "response",
    "compacted",
)


def turn_place(conversation_id: UUID, seq: int, field: str) -> bytes:
    return place("turn", conversation_id, seq, field)


def metadata_place(conversation_id: UUID) -> bytes:
    return place("conversation", conversation_id, 0, "metadata")


def events_place(run_id: UUID, seq: int) -> bytes:
    return place("run", run_id, seq, "events")


def run_response_place(run_id: UUID) -> bytes:
    return place("run", run_id, 0, "response")


def put(key: DataKey | None, where: bytes, value: str | None) -> tuple[str | None, bytes | None]:
    """The (clear, sealed) column values of ``value``: sealed when there is a key."""
    if value is None or key is None:
        return value, None
    return None, key.seal(where, value.encode())


def get(key: DataKey | None, where: bytes, clear: Any, sealed: bytes | None) -> Any:
    """A field's value from its (clear, sealed) columns."""
    if sealed is None:
        return clear
    if key is None:
        log.error("a stored value is encrypted, but its owner has no data key here: %s", where)
        raise StorageError(UNREADABLE)
    return key.open(where, sealed).decode()


def check_row(
    row: Any, names: Iterable[str], required: Iterable[str], where: Callable[[], bytes]
) -> None:
    """A row is written all in clear or all sealed, with its required fields: anything else
    was altered outside turnstore (a sealed value swapped for clear text, or one removed).
    ``where`` names the row for the log, if it must."""
    names = tuple(names)
    clear = any(row[name] is not None for name in names)
    sealed = any(row[f"sealed_{name}"] is not None for name in names)
    missing = any(row[name] is None and row[f"sealed_{name}"] is None for name in required)
    if (clear and sealed) or missing:
        log.error("a stored row mixes clear and sealed fields or lacks one: %s", where())
        raise StorageError(UNREADABLE)


def sealed_turn_columns(
    key: DataKey | None, conversation_id: UUID, seq: int, values: Mapping[str, Any]
) -> dict[str, Any]:
    """The clear and sealed columns of a turn's encrypted fields."""
    columns: dict[str, Any] = {}
    if key is None:  # in clear: no place to seal for (each is a str of the id)
        for name in TURN_FIELDS:
            columns[name], columns[f"sealed_{name}"] = values[name], None
        return columns
    for name in TURN_FIELDS:
        clear, sealed = put(key, turn_place(conversation_id, seq, name), values[name])
        columns[name], columns[f"sealed_{name}"] = clear, sealed
    return columns


def is_sealed(row: Any, names: Iterable[str]) -> bool:
    """Whether a row (a mapping of columns) holds any of these fields sealed."""
    return any(row.get(f"sealed_{name}") is not None for name in names)


async def reading_key(
    keyring: Keyring | None, owner: str, rows: Iterable[Any], names: Iterable[str]
) -> DataKey | None:
    """The owner's data key if any of ``rows`` holds a sealed field (None otherwise: rows in
    clear need no keyring)."""
    fields = tuple(names)
    if keyring is None or not any(is_sealed(row, fields) for row in rows):
        return None
    return await keyring.for_read(owner)


async def writing_key(keyring: Keyring | None, owner: str) -> DataKey | None:
    """The key ``owner``'s new values are sealed with (None: written in clear)."""
    return None if keyring is None else await keyring.for_write(owner)
