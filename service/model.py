"""The conversation as the use case sees it: committed turns and what a new turn adds.

Replay items are kept as ``msgspec.Raw``: the provider's JSON bytes, never decoded into
Python objects, so they are stored and re-sent exactly as the provider defined them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal
from uuid import UUID

import msgspec

from service.tools.gate import ToolCallRecord

Role = Literal["user", "assistant"]

ANONYMOUS = "anonymous"  # the one owner when AUTH_MODE=none

# The revisions an If-Match header accepts; None means "no precondition".
Precondition = frozenset[int] | None


@dataclass(frozen=True)
class Origin:
    """Which provider, endpoint and model produced a turn's replay items. Sealed reasoning
    (``encrypted_content``) only decrypts where it was made."""

    provider: str
    endpoint: str
    model: str


@dataclass(frozen=True)
class Turn:
    """One user message and the accepted reply, as it is committed."""

    user_message: str
    assistant_message: str
    replay_items: list[msgspec.Raw]
    origin: Origin | None = None  # None: recorded before origins were (schema 0001)
    context_from: int = 1  # the first earlier turn the model saw for this turn
    prompt_version: str | None = None  # the system prompt's version, if there was one
    tool_calls: Sequence[ToolCallRecord] = ()  # every tool call of the turn, in order


@dataclass(frozen=True)
class Conversation:
    id: UUID
    revision: int
    created_at: datetime
    updated_at: datetime
    turns: list[Turn] = field(default_factory=list)
    context_start: int = 1  # turns before this one are outside the model's context
    owner: str = ANONYMOUS

    @property
    def replay_items(self) -> list[msgspec.Raw]:
        return [item for turn in self.turns for item in turn.replay_items]


@dataclass(frozen=True)
class Summary:
    """A conversation in a listing (no turns)."""

    id: UUID
    revision: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class IdempotencyKey:
    owner: str
    key: str
    request_hash: str  # of what the request asked, so a reused key with another body is caught


@dataclass(frozen=True)
class Commit:
    """What the store reports after a successful append."""

    revision: int
    created_at: datetime
    updated_at: datetime
