"""The store port. Every adapter raises only the domain errors named here."""

from __future__ import annotations

from typing import Protocol
from uuid import UUID

from service.model import (
    ANONYMOUS,
    Commit,
    Conversation,
    IdempotencyKey,
    Precondition,
    Summary,
    Turn,
)


class ConversationStore(Protocol):
    async def load(self, conversation_id: UUID) -> Conversation | None:
        """The conversation with every committed turn in order, or None (unknown, deleted or
        expired). Its ``owner`` is for the caller to check. Raises StorageError."""

    async def append(
        self,
        conversation_id: UUID,
        turn: Turn,
        expected_revision: int,
        *,
        owner: str = ANONYMOUS,
        idempotency: tuple[IdempotencyKey, str] | None = None,
    ) -> Commit:
        """Commit ``turn`` if ``owner``'s conversation is still at ``expected_revision``.

        ``expected_revision == 0`` creates the conversation with this first turn, in the same
        transaction. ``idempotency`` (key, response) marks the key done in that transaction
        too. Raises ConversationConflict (nothing written) when another writer got there
        first, ConversationNotFound when it was deleted or expired meanwhile, StorageError.
        """

    async def delete(
        self, conversation_id: UUID, owner: str = ANONYMOUS, if_match: Precondition = None
    ) -> None:
        """Remove the owner's conversation and everything of it, if its revision is in
        ``if_match``. Raises ConversationNotFound, PreconditionFailed, StorageError."""

    async def list_conversations(
        self, owner: str, limit: int, after: str | None = None
    ) -> tuple[list[Summary], str | None]:
        """A page of the owner's conversations, newest first, and the next page's cursor."""

    async def purge(self, batch: int = 500) -> int:
        """Delete conversations past the retention period; the number deleted."""

    async def schema_revision(self) -> str | None:
        """The migration revision the database is at (None before the first migration)."""

    def pool_in_use(self) -> int:
        """Database connections this process has checked out now (for /metrics)."""

    async def close(self) -> None: ...
