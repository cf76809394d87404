"""The store port. Every adapter raises only the domain errors named here."""

from __future__ import annotations

from typing import Protocol
from uuid import UUID

from service.model import Commit, Conversation, Precondition, Turn


class ConversationStore(Protocol):
    async def load(self, conversation_id: UUID) -> Conversation | None:
        """The conversation with every committed turn in order, or None.

        Raises StorageError when the database fails.
        """

    async def append(self, conversation_id: UUID, turn: Turn, expected_revision: int) -> Commit:
        """Commit ``turn`` if the conversation is still at ``expected_revision``.

        ``expected_revision == 0`` creates the conversation with this first turn, in the same
        transaction. Raises ConversationConflict (nothing written) when another writer got there
        first, ConversationNotFound when the conversation was deleted meanwhile, StorageError when
        the database fails.
        """

    async def delete(self, conversation_id: UUID, if_match: Precondition = None) -> None:
        """Remove the conversation and everything of it, if its revision is in ``if_match``.

        Raises ConversationNotFound, PreconditionFailed (nothing deleted), StorageError.
        """

    async def schema_revision(self) -> str | None:
        """The migration revision the database is at (None before the first migration)."""

    def pool_in_use(self) -> int:
        """Database connections this process has checked out now (for /metrics)."""

    async def close(self) -> None: ...
