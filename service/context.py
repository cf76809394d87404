"""The context window: which earlier turns a provider request carries.

The window is a suffix of whole turns (a turn's user item and all its output items go or stay
together, so a reasoning item never loses the item it precedes). Limits are deterministic
transport limits, not token counts: at most ``max_turns`` earlier turns, and a serialised
request of at most ``max_request_bytes`` UTF-8 bytes. The window start never moves back: it
is committed with each turn and only ever advances.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from service.errors import ContextLengthExceeded


@dataclass(frozen=True)
class Budget:
    max_turns: int | None = None
    max_request_bytes: int = 1_048_576


def turn_bytes(items: Sequence[msgspec.Raw]) -> int:
    """What a turn's items add to a request's ``input`` array: each item and its comma."""
    return sum(len(item) + 1 for item in items)


def window_start(
    turn_sizes: Sequence[int], committed_start: int, fixed_bytes: int, budget: Budget
) -> int:
    """The first turn (1-based) to send: the smallest start at or after ``committed_start``
    whose suffix of turns fits. ``len(turn_sizes) + 1`` means no earlier turn fits.

    ``fixed_bytes`` is the request without earlier turns (envelope, instructions and the
    new user item). Raises ContextLengthExceeded when even that alone is over the budget.
    """
    if fixed_bytes > budget.max_request_bytes:
        raise ContextLengthExceeded(
            "The message (with the system prompt) alone exceeds the context budget."
        )
    count = len(turn_sizes)
    start = max(committed_start, 1)
    if budget.max_turns is not None:
        start = max(start, count + 1 - budget.max_turns)
    size = fixed_bytes + sum(turn_sizes[start - 1 :])
    while start <= count and size > budget.max_request_bytes:
        size -= turn_sizes[start - 1]
        start += 1
    return start


@dataclass(frozen=True)
class SystemPrompt:
    """The operator's system prompt, sent as ``instructions``; its version is a hash of its
    text, recorded with every turn. It is never stored in a conversation."""

    text: str
    version: str

    @classmethod
    def from_file(cls, path: Path) -> SystemPrompt:
        text = path.read_text(encoding="utf-8")
        return cls(text, "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16])
