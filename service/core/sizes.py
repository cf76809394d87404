"""How much a conversation holds, counted against MAX_CONVERSATION_BYTES (the contract's
Limits): the items its turns store, as the client and the provider sent them (their JSON
bytes, uncompressed, never PostgreSQL's compressed size). Every message, reply and tool call
is one of those items; the texts and the transcript stored beside them are read from them,
so they are not counted twice (a conversation of 60 MB of appended items holds 60 MB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.core.errors import ConversationFull
from service.core.model import Turn


def turn_bytes(turn: Turn) -> int:
    """What ``turn`` stores: its replay items and its compacted context."""
    return turn.replay_bytes + sum(map(len, turn.compacted))


def held_bytes(turns: Iterable[Turn]) -> int:
    return sum(map(turn_bytes, turns))


@dataclass(frozen=True)
class SizeLimit:
    """MAX_CONVERSATION_BYTES: a conversation holding ``held`` bytes may not take ``adding``
    more if that passes ``max_bytes`` (ConversationFull: nothing is kept). None: no limit."""

    max_bytes: int | None = None

    def check(self, held: int, adding: int) -> int:
        """The conversation's size with ``adding``, or ConversationFull."""
        total = held + adding
        if self.max_bytes is not None and total > self.max_bytes:
            raise ConversationFull()
        return total
