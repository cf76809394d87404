"""What both surfaces do to a conversation besides a turn: read it, list, fork, delete, and the
item edits of the OpenAI surface (items appended without the model, the latest one removed),
each a commit under the same rules as a turn's (If-Match, the revision, the lease), and each
write through the write gate (service/usecases/write_gate.py: its Idempotency-Key, the owner's
write budget) with its bytes counted as a turn's are (core/sizes.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    InvalidInput,
    ItemNotFound,
    PreconditionFailed,
)
from service.core.export_lines import Imported
from service.core.items import items_turn, listed_ids
from service.core.model import (
    Append,
    Committed,
    ConversationInfo,
    IdempotencyKey,
    PageRequest,
    Precondition,
    Removal,
    Summary,
    TranscriptPage,
    Turn,
)
from service.core.plans import check_precondition
from service.core.search import Finding
from service.core.sizes import SizeLimit, turn_bytes
from service.core.usage import UsageTotal
from service.store.ports import Edits, History, Reads
from service.usecases.exporting import exported
from service.usecases.paging import held_bytes, walk
from service.usecases.restore import Restorer
from service.usecases.write_gate import WriteGate

# An append loses to a turn that runs (its lease) as well as to one that committed first.
ITEMS_CONFLICT = (
    "A turn of this conversation is running or was committed meanwhile; the items were not "
    "appended. Retry once it is done."
)

T = TypeVar("T")


class Conversations:
    def __init__(
        self,
        reads: Reads,
        history: History,
        edits: Edits,
        restorer: Restorer,
        size_limit: SizeLimit | None = None,
        gate: WriteGate | None = None,
    ) -> None:
        self._reads, self._history, self._edits = reads, history, edits
        self._restorer = restorer
        self._size = size_limit or SizeLimit()
        self._gate = gate or WriteGate(None)

    # --- reading ------------------------------------------------------------------------------

    async def describe(self, cid: uuid.UUID, owner: str) -> ConversationInfo:
        info = await self.info(cid, owner)
        if info is None:
            raise ConversationNotFound()
        return info

    async def info(self, cid: uuid.UUID, owner: str) -> ConversationInfo | None:
        return await self._reads.describe(cid, owner)

    async def walk(
        self, cid: uuid.UUID, owner: str, *, newest_first: bool
    ) -> AsyncGenerator[tuple[int, Turn], None]:
        """Its turns with their revisions, oldest or newest first, read a page at a time (what
        a reader of its items holds is a page, whatever its size; the Limits section).
        ConversationNotFound before the first."""
        high = (await self.describe(cid, owner)).revision
        async for numbered in walk(self._reads, cid, owner, 1, high, newest_first=newest_first):
            yield numbered

    async def transcript(self, cid: uuid.UUID, owner: str, page: PageRequest) -> TranscriptPage:
        found = await self._reads.transcript(cid, owner, page)
        if found is None:
            raise ConversationNotFound()
        return found

    async def listing(
        self, owner: str, limit: int, after: str | None, finding: Finding | None = None
    ) -> tuple[list[Summary], str | None]:
        return await self._reads.list_conversations(owner, limit, after, finding)

    async def usage(
        self, owner: str, since: datetime, until: datetime, group_by: str
    ) -> list[UsageTotal]:
        return await self._reads.usage(owner, since, until, group_by)

    async def export(self, cid: uuid.UUID, owner: str) -> AsyncIterator[bytes]:
        """Its ndjson lines (service/usecases/exporting.py). ConversationNotFound before the
        first line."""
        return exported(self._reads, await self.describe(cid, owner), owner)

    async def turn_at(self, cid: uuid.UUID, owner: str, revision: int) -> Turn | None:
        """The turn that made ``revision`` (None: no such turn of the owner's), read alone."""
        return await self._reads.turn(cid, owner, revision)

    # --- writing: each through the write gate (service/usecases/write_gate.py) --------------

    async def create(
        self,
        owner: str,
        metadata: dict[str, str],
        items: Sequence[object] | None,
        key: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        key = key and key.making()  # its id fixed with the claim

        async def write() -> ConversationInfo:
            turn = await self._restored(owner, items)
            size = self._size.check(0, turn_bytes(turn)) if turn is not None else 0
            return await self._charged(
                owner, size, lambda: self._edits.create_conversation(owner, metadata, turn, key)
            )

        return await self._gate.once(key, write, lambda done: self._now(done, owner))

    async def import_conversation(
        self, owner: str, imported: Imported, key: IdempotencyKey | None = None
    ) -> ConversationInfo:
        """A new conversation of ``owner``'s made of an export, in one commit: counted against
        MAX_CONVERSATION_BYTES and the owner's write budget first, through the write gate."""
        key = key and key.making()  # its id fixed with the claim

        async def write() -> ConversationInfo:
            size = self._size.check(0, imported.size)
            return await self._charged(
                owner, size, lambda: self._edits.import_conversation(owner, imported, key)
            )

        return await self._gate.once(key, write, lambda done: self._now(done, owner))

    async def update_metadata(
        self,
        cid: uuid.UUID,
        owner: str,
        metadata: dict[str, str],
        if_match: Precondition,
        key: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        key = key and key.writing(cid)

        async def write() -> ConversationInfo:
            adding = sum(len(k) + len(v) for k, v in metadata.items())
            return await self._charged(
                owner,
                adding,
                lambda: self._edits.update_metadata(cid, owner, metadata, if_match, key),
            )

        return await self._gate.once(key, write, lambda done: self._now(done, owner))

    async def delete_response(
        self,
        cid: uuid.UUID,
        owner: str,
        revision: int,
        key: IdempotencyKey | None = None,
        *,
        erase: bool = False,
    ) -> bool:
        """Forget a response (its turn stays); ``erase``: its content too (the latest turn's:
        History.delete_response)."""
        return await self._history.delete_response(Removal(cid, owner, key), revision, erase=erase)

    async def delete(
        self,
        cid: uuid.UUID,
        owner: str,
        if_match: Precondition,
        key: IdempotencyKey | None = None,
    ) -> None:
        async def deleted(_: Committed) -> None:
            return None

        key = key and key.writing(cid)
        await self._gate.once(key, lambda: self.remove(cid, owner, if_match, key), deleted)

    async def remove(
        self, cid: uuid.UUID, owner: str, if_match: Precondition, key: IdempotencyKey | None
    ) -> None:
        """``delete`` for a caller that passed the write gate already (its ``key``, completed
        by the deletion's transaction)."""
        await self._history.delete(Removal(cid, owner, key), if_match)

    async def fork(
        self, cid: uuid.UUID, owner: str, at_revision: int, key: IdempotencyKey | None = None
    ) -> ConversationInfo:
        """A new conversation holding turns 1..``at_revision`` of this one: what it copies is
        counted against MAX_CONVERSATION_BYTES and the owner's write budget first."""
        key = key and key.making()  # the fork's id fixed with the claim

        async def write() -> ConversationInfo:
            source = await self.describe(cid, owner)
            if not 1 <= at_revision <= source.revision:
                raise InvalidInput("at_revision must be a revision of the conversation.")
            size = await held_bytes(self._reads, cid, owner, at_revision, source)
            self._size.check(size, 0)
            return await self._charged(
                owner, size, lambda: self._edits.fork(cid, owner, at_revision, key)
            )

        return await self._gate.once(key, write, lambda done: self._now(done, owner))

    async def append_items(
        self,
        cid: uuid.UUID,
        owner: str,
        items: Sequence[object],
        if_match: Precondition,
        key: IdempotencyKey | None = None,
    ) -> tuple[Turn, int]:
        """Commit ``items`` (appended without the model) on top of the conversation's current
        revision: 409 conversation_conflict if another turn commits or runs meanwhile. The
        turn, and the revision it made."""
        key = key and key.writing(cid)

        async def write() -> tuple[Turn, int]:
            turn = await self._restored(owner, items)
            if turn is None:
                raise InvalidInput("items: at least one.", param="items")
            info = await self.describe(cid, owner)
            check_precondition(if_match, info.revision)
            held = 0
            if self._size.max_bytes is not None:
                held = await held_bytes(self._reads, cid, owner, info.revision, info)
            adding = turn_bytes(turn)
            size = self._size.check(held, adding)
            append = Append(
                cid, turn, info.revision, owner=owner, stored_bytes=size, idempotency=key
            )
            try:
                commit = await self._charged(owner, adding, lambda: self._history.append(append))
            except ConversationConflict:
                raise ConversationConflict(ITEMS_CONFLICT) from None
            return turn, commit.revision

        async def appended(done: Committed) -> tuple[Turn, int]:
            cid, revision = done.turn
            turn = await self.turn_at(cid, owner, revision)
            if turn is None:
                raise ConversationNotFound()  # deleted or expired since
            return turn, revision

        return await self._gate.once(key, write, appended)

    async def _charged(self, owner: str, size: int, write: Callable[[], Awaitable[T]]) -> T:
        """``write``, its ``size`` bytes admitted against the owner's write budget first (else
        TooManyRequests) and charged once it committed (given back when it did not)."""
        with self._gate.budget.spending(owner, size) as spend:
            done = await write()
            spend(size)
        return done

    async def _now(self, done: Committed, owner: str) -> ConversationInfo:
        """The conversation an earlier attempt with the same key made or changed, as it is
        now (a retry's answer)."""
        return await self.describe(done.turn[0], owner)

    async def _restored(self, owner: str, items: Sequence[Any] | None) -> Turn | None:
        """The turn that appends ``items``, those turnstore showed restored to their stored
        bytes (service/usecases/restore.py)."""
        turn = items_turn(items)
        if turn is None or items is None:
            return turn
        replay_items, origin = await self._restorer.kept(owner, items, "items")
        return replace(turn, replay_items=replay_items, origin=origin)

    async def pop_item(
        self,
        cid: uuid.UUID,
        owner: str,
        item_id: str,
        if_match: Precondition,
        key: IdempotencyKey | None = None,
    ) -> ConversationInfo:
        """Remove ``item_id`` if it is the conversation's latest item (the Agents SDK's
        pop_item); any other item is 400, an unknown one 404. A commit between the look and
        the removal makes it 409, with nothing removed."""
        key = key and key.writing(cid)

        async def write() -> ConversationInfo:
            revision = (await self.describe(cid, owner)).revision
            check_precondition(if_match, revision)
            ids = await self._restorer.ids.get()
            last = await self._reads.turn(cid, owner, revision) if revision else None
            latest = listed_ids(ids, cid, revision, last) if last is not None else []
            if not latest or latest[-1] != item_id:
                ref = ids.parse_item(item_id)  # names the one turn that holds it
                if ref is not None and ref.conversation_id == cid and ref.revision < revision:
                    earlier = await self._reads.turn(cid, owner, ref.revision)
                    if earlier is not None and item_id in listed_ids(
                        ids, cid, ref.revision, earlier
                    ):
                        raise InvalidInput("Only the latest item can be removed.", param="item_id")
                raise ItemNotFound()
            assert last is not None  # its latest item is named: it has a last turn
            rewritten = turn_bytes(last)  # (the last turn, written again without its item)
            unchanged = frozenset({revision})
            try:
                info, _ = await self._charged(
                    owner,
                    rewritten,
                    lambda: self._history.pop_item(Removal(cid, owner, key), unchanged),
                )
            except PreconditionFailed:
                raise ConversationConflict() from None
            return info

        return await self._gate.once(key, write, lambda done: self._now(done, owner))
