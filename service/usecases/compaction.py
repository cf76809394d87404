"""Compaction: a long conversation's older context turned by the provider into one opaque
``compaction`` item instead of being cut (the contract's "Compaction").

A turn compacts when its input (its window plus its new input) passes its threshold
(``context_management`` on /v1, or ``CONTEXT_STRATEGY=compact`` with
``COMPACT_THRESHOLD_TOKENS`` for every turn). The input is counted in the provider's tokens
from the last usage it reported (the latest turn's input and output: what the window held
then and what it added), plus an estimate of what is new. A turn's usage adds up all its
calls, so where it made more than one (tool rounds, a compaction) or reported none, the whole
input is estimated instead (a token per four bytes, the fake's and a fair rule for JSON).

The compacted context (the user messages the provider kept, then its compaction item)
replaces the window for this turn's call and is committed **with the turn**, in its one
conditional commit (service/usecases/turns.py): a turn that fails keeps no compaction, and a
compaction cannot lose a turn another replica committed meanwhile, since it is never written
on its own. Later windows start at it (service/core/window.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec

from service.core.model import Conversation
from service.core.usage import Usage
from service.core.window import Window, items_bytes
from service.platform import metrics
from service.providers.base import Provider, ProviderRequest

BYTES_PER_TOKEN = 4  # the estimate where the provider reported no usage


@dataclass(frozen=True)
class CompactedWindow:
    window: Window  # the compacted context, to send instead of the earlier turns
    usage: Usage | None  # of the compaction call


def input_tokens(
    conversation: Conversation | None, window: Window, new_items: Sequence[msgspec.Raw]
) -> int:
    """A turn's input in the provider's tokens (see the module's docstring)."""
    new = math.ceil(items_bytes(new_items) / BYTES_PER_TOKEN)
    last = conversation.last if conversation else None
    one_call = last is not None and not last.tool_calls and not last.compacted
    if last is not None and one_call and last.usage is not None and last.replay_items:
        return last.usage.input_tokens + last.usage.output_tokens + new
    return math.ceil(items_bytes(window.items) / BYTES_PER_TOKEN) + new


def due(
    threshold: int | None,
    conversation: Conversation | None,
    window: Window,
    new_items: Sequence[msgspec.Raw],
) -> bool:
    """Whether the turn compacts its window first: over its threshold, with earlier context
    to compact."""
    if threshold is None or not window.items:
        return False
    return input_tokens(conversation, window, new_items) > threshold


async def compact(
    provider: Provider, window: Window, template: ProviderRequest, revision: int
) -> CompactedWindow:
    """The provider's compaction of ``window`` (with the turn's model and instructions), as
    the window of the turn that makes ``revision``."""
    compacted = await provider.compact(replace(template, input_items=window.items))
    if compacted.usage is not None:
        metrics.tokens_used(template.model or provider.origin.model, compacted.usage)
    return CompactedWindow(window.compacted_to(compacted.items, revision), compacted.usage)
