"""How much a conversation holds, counted against MAX_CONVERSATION_BYTES (the contract's
Limits): every byte a turn stores, as it is stored (its JSON or UTF-8 bytes, uncompressed,
never PostgreSQL's compressed size). That is its replay items and compacted context, its two
texts and its transcript, its tool calls, and the request fields its /v1 Response echoes. The
database measures the same columns the same way where a row does not say its size
(store/postgres/statements.py, TURN_SIZES), and the history cache counts its entries with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.core.errors import ConversationFull
from service.core.model import Turn
from service.core.translate import is_opaque


def turn_bytes(turn: Turn) -> int:
    """What ``turn`` stores (and what holding it in memory costs, roughly): its replay items
    and compacted context, its two texts (UTF-8), its transcript and tool calls (JSON) and
    its /v1 Response's echo (``Turn.stored_bytes``, counted once per turn)."""
    return turn.stored_bytes


def held_bytes(turns: Iterable[Turn]) -> int:
    return sum(map(turn_bytes, turns))


@dataclass(frozen=True)
class TurnSizes:
    """What a turn takes, stored with it (so that reading its sizes reads none of it): its
    items (compacted context included) as a request carries them (each item and its comma,
    core/window.py ``items_bytes``), the opaque ones among them (left out of a request to
    another origin), and all it stores (``turn_bytes``)."""

    items: int
    opaque: int
    stored: int

    @classmethod
    def of(cls, turn: Turn) -> TurnSizes:
        items = [*turn.compacted, *turn.replay_items]
        opaque = sum(len(item) + 1 for item in items if is_opaque(item))
        return cls(sum(map(len, items)) + len(items), opaque, turn_bytes(turn))


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
