"""Which turns make a transcript page: shared by the stores, so both cut pages alike."""

from __future__ import annotations

from collections.abc import Sequence

from service.core.model import Conversation, PageRequest, TranscriptPage, TranscriptTurn


def fitting(sizes: Sequence[tuple[int, int]], page: PageRequest) -> list[int]:
    """The turns to read, from (turn number, text bytes) in reading order: at most
    ``page.limit`` of them, and no more bytes than ``page.max_bytes`` once one is taken."""
    chosen: list[int] = []
    total = 0
    for number, size in sizes[: page.limit]:
        if chosen and total + size > page.max_bytes:
            break
        chosen.append(number)
        total += size
    return sorted(chosen)


def page_of(
    conversation: Conversation, turns: list[TranscriptTurn], page: PageRequest, *, fetched: int
) -> TranscriptPage:
    """The page of ``turns`` (chosen by ``fitting`` out of ``fetched`` read in order)."""
    cut = fetched > len(turns)  # more turns lay beyond the page, in reading order
    beyond = page.before is not None and page.before <= conversation.revision
    if page.backwards:
        return TranscriptPage(conversation, turns, more_before=cut, more_after=beyond)
    earlier = page.after > 0 and conversation.revision > 0
    return TranscriptPage(conversation, turns, more_before=earlier, more_after=cut or beyond)
