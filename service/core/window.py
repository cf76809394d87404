"""The context window: which earlier turns a provider request carries, and how big it is.

The window is a suffix of whole turns (a turn's user item and all its output items go or stay
together, so a reasoning item never loses the item it precedes). Limits are deterministic
transport limits, not token counts: at most ``max_turns`` earlier turns, and a serialised
request of at most ``max_request_bytes`` UTF-8 bytes. The window start never moves back: it
is committed with each turn and only ever advances.

It stays where it is until a limit forces it on, and then moves past a low-water mark (the
earlier turns down to 3/4 of what the byte budget leaves them, and ``max_turns`` less a
quarter, rounded down: a window of 1 to 3 turns still slides), not just as far as the limit
needs: a provider's prompt cache holds the previous
request's prefix, which a window that slid by one turn every turn would change on every turn
(every turn paying its whole input in full); this way it changes on one turn in several.

This module is the one place that counts a request's bytes (``request_bytes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import msgspec

from service.core.errors import ContextLengthExceeded
from service.core.model import Origin, Turn
from service.core.translate import neutral


@dataclass(frozen=True)
class Budget:
    max_turns: int | None = None
    max_request_bytes: int = 1_048_576


def items_bytes(items: Sequence[msgspec.Raw]) -> int:
    """What items add to a request's ``input`` array: each item and its comma."""
    return sum(len(item) + 1 for item in items)


def request_bytes(overhead: int, items: Sequence[msgspec.Raw]) -> int:
    """The size of a request whose envelope (everything but the ``input`` items) is
    ``overhead`` bytes (one comma fewer than items)."""
    return overhead + items_bytes(items) - (1 if items else 0)


def window_start(
    turn_sizes: Sequence[int], committed_start: int, fixed_bytes: int, budget: Budget
) -> int:
    """The first turn (its place, from 1) to send: ``committed_start`` when its suffix of
    turns fits; else the smallest later start whose suffix fits the low-water mark
    (``low_water``), but never one that leaves out the newest turn when the budget holds it.
    ``len(turn_sizes) + 1`` means no earlier turn is sent.

    ``fixed_bytes`` is the request without earlier turns (envelope, instructions and the
    new user item); ``turn_sizes`` what each turn's items add (their bytes and commas).
    Raises ContextLengthExceeded when the fixed part alone is over the budget.
    """
    if fixed_bytes > budget.max_request_bytes:
        raise ContextLengthExceeded(
            "The message (with the system prompt) alone exceeds the context budget."
        )
    start = max(committed_start, 1)
    if _fits(turn_sizes, start, fixed_bytes, budget):
        return start
    lowered = _fitting_start(turn_sizes, start, fixed_bytes, low_water(budget, fixed_bytes))
    # Never past the newest turn the budget itself keeps: under a low-water mark that one
    # large turn alone passes, the request would carry no history at all.
    kept = _fitting_start(turn_sizes, start, fixed_bytes, budget)
    return min(lowered, max(kept, len(turn_sizes)))


def low_water(budget: Budget, fixed_bytes: int) -> Budget:
    """What a window that had to move is cut down to: the earlier turns to 3/4 of the bytes
    the budget leaves them, ``max_turns`` less a quarter (rounded down)."""
    turns = budget.max_turns
    lowered = None if turns is None else turns - turns // 4
    room = budget.max_request_bytes - fixed_bytes
    return Budget(lowered, fixed_bytes + room * 3 // 4)


def _fits(turn_sizes: Sequence[int], start: int, fixed_bytes: int, budget: Budget) -> bool:
    kept = turn_sizes[start - 1 :]
    if budget.max_turns is not None and len(kept) > budget.max_turns:
        return False
    return fixed_bytes + sum(kept) <= budget.max_request_bytes


def _fitting_start(turn_sizes: Sequence[int], start: int, fixed_bytes: int, budget: Budget) -> int:
    """The smallest start at or after ``start`` whose suffix of turns fits ``budget``."""
    count = len(turn_sizes)
    if budget.max_turns is not None:
        start = max(start, count + 1 - budget.max_turns)
    size = fixed_bytes + sum(turn_sizes[start - 1 :])
    while start <= count and size > budget.max_request_bytes:
        size -= turn_sizes[start - 1]
        start += 1
    return start


@dataclass(frozen=True)
class Window:
    """The earlier context one turn sends: the first turn it holds, and its items as this
    provider can take them (``unsealed``: the same as another origin would get them, without
    opaque items or signatures, for the one retry).
    ``compacted``: the compacted context it holds in place of earlier turns (the kept user
    messages, then the compaction item), when this turn made it (see ``compacted_to``)."""

    start: int
    items: list[msgspec.Raw]
    compacted: tuple[msgspec.Raw, ...] = ()
    # Its items are all Responses items, known from its turns (``Turn.responses_only``) without
    # looking at them again (False: not known).
    plain: bool = False

    @cached_property
    def unsealed(self) -> list[msgspec.Raw]:
        return _neutral(self.items)

    def compacted_to(self, items: Sequence[msgspec.Raw], revision: int) -> Window:
        """This window compacted by the turn that makes ``revision``: later windows start at
        that turn, with ``items`` before it."""
        return Window(revision, list(items), tuple(items))


def choose_window(
    turns: Sequence[Turn],
    committed_start: int,
    origin: Origin,
    fixed_bytes: int,
    budget: Budget,
) -> Window:
    """The window for a new turn over ``turns``: the committed turns from the committed
    window start on (or more), in order, each numbered by the revision it made (a turn
    without a number, by its place from 1). It never starts before the latest compacting
    turn, whose compacted context comes first. Its start is the revision of the first turn
    it holds, or the lower bound it had to keep (the committed start, the compacting turn)
    when it holds every turn from there: a window start never names a turn that was not
    left out."""
    # One pass over the turns (a window is read at every turn, over every turn held): each
    # turn's number, whether this origin made its items (asked once per run of turns of one
    # origin: a conversation's turns share a few), and its size as sent.
    numbers: list[int] = []
    owns: list[bool] = []
    sizes: list[int] = []
    compacting = 0  # the number of the latest compacting turn (0: none)
    made: object = _UNSEEN
    own = False
    for n, turn in enumerate(turns, 1):
        if turn.origin is not made:
            made, own = turn.origin, _own(turn, origin)
        number = turn.number or n
        numbers.append(number)
        owns.append(own)
        sizes.append(_sendable_bytes(turn, own, False))
        if turn.compacted:
            compacting = max(compacting, number)
    if compacting:  # its compacted context comes first: its size with it
        for at, number in enumerate(numbers):
            if number == compacting:
                sizes[at] = _sendable_bytes(turns[at], owns[at], True)
    lower = max(committed_start, compacting)
    kept = next((i for i, n in enumerate(numbers, 1) if n >= lower), len(numbers) + 1)
    place = window_start(sizes, kept, fixed_bytes, budget)
    if place == kept:
        start = lower
    else:
        start = numbers[place - 1] if place <= len(numbers) else numbers[-1] + 1
    items: list[msgspec.Raw] = []
    # A turn of another origin is sent as its neutral items (looked at on the way), which are
    # not counted as known here.
    plain = True
    for at in range(place - 1, len(numbers)):
        turn, own = turns[at], owns[at]
        items.extend(_sendable(turn, own, numbers[at] == compacting))
        plain = plain and own and turn.responses_only
    return Window(start, items, plain=plain)


_UNSEEN = object()  # no turn's origin


def _own(turn: Turn, origin: Origin) -> bool:
    """Whether ``origin`` made the turn's items (or it was recorded before origins were)."""
    return turn.origin is None or turn.origin == origin


def _sendable_bytes(turn: Turn, own: bool, with_compacted: bool) -> int:
    """What ``_sendable`` of the turn adds to a request: most turns send their replay items
    as they are, whose bytes the turn counted once."""
    if with_compacted or not own:
        return items_bytes(_sendable(turn, own, with_compacted))
    return turn.replay_bytes + len(turn.replay_items)


def _sendable(turn: Turn, own: bool, with_compacted: bool) -> Sequence[msgspec.Raw]:
    """A turn's items, verbatim (after the compacted context it ran on, for the latest
    compacting turn), when this provider made them (``own``); a turn another provider,
    endpoint or model made as any other origin gets it (service/core/translate/ ``neutral``):
    its opaque items (sealed reasoning, compaction items, thinking) left out, a provider's own
    items as the Responses items they read as, without their signatures."""
    items = [*turn.compacted, *turn.replay_items] if with_compacted else turn.replay_items
    return items if own else _neutral(items)


def _neutral(items: Sequence[msgspec.Raw]) -> list[msgspec.Raw]:
    return [kept for item in items for kept in neutral(item)]


@dataclass(frozen=True)
class SystemPrompt:
    """The operator's system prompt, sent as ``instructions``; its version is a hash of its
    text, recorded with every turn. It is never stored in a conversation."""

    text: str
    version: str

    @classmethod
    def of(cls, text: str) -> SystemPrompt:
        return cls(text, "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16])

    @classmethod
    def from_file(cls, path: Path) -> SystemPrompt:
        return cls.of(path.read_text(encoding="utf-8"))


def instructions_for(
    server: SystemPrompt | None, client: str | None, *, server_first: bool
) -> SystemPrompt | None:
    """What a turn sends as ``instructions``: the server's prompt, then (``server_first``) or
    instead of it the client's instructions for this turn; its version is the digest of what
    was sent, recorded with the turn (never the text)."""
    if client is None:
        return server
    if server is None or not server_first:
        return SystemPrompt.of(client)
    return SystemPrompt.of(f"{server.text}\n\n{client}")
