"""A response's life after it is asked (service/usecases/responses.py): found as it is now
(retrieve, its input items), its events replayed, cancelled wherever it runs, deleted.
The reads of the OpenAI surface, apart from asking, as views are apart from commands.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import dataclass, replace
from typing import Any

from service.core.errors import InvalidInput, ResponseNotFound
from service.core.events import RunEvent
from service.core.ids import Ids, ResponseRef
from service.core.model import Committed, IdempotencyKey, RunView, Turn
from service.usecases.conversations import Conversations
from service.usecases.restore import Restorer
from service.usecases.runs import TurnRuns
from service.usecases.turns import TurnService


@dataclass(frozen=True)
class Found:
    """A response as it is now: its turn once committed, and the run that makes (or made)
    it, if it ran as one."""

    id: str
    conversation_id: uuid.UUID
    revision: int | None  # of its committed turn (None: not committed)
    turn: Turn | None
    run: RunView | None
    stored: bool = False  # in a stored response's conversation (not shown: OpenAI has none)
    latest: int | None = None  # its conversation's revision when found (None: not made yet)

    @property
    def response(self) -> Any:
        """What the response echoes (its turn's record, or its run's while it runs)."""
        if self.turn is not None and self.turn.response is not None:
            return self.turn.response
        return self.run.response if self.run is not None else None


class KeptResponses:
    """The responses turnstore keeps, by the id it showed."""

    def __init__(
        self, turns: TurnService, runs: TurnRuns, restorer: Restorer, conversations: Conversations
    ) -> None:
        self._turns, self._runs, self._restorer = turns, runs, restorer
        self._conversations = conversations

    async def ids(self) -> Ids:
        return await self._restorer.ids.get()

    async def find(self, owner: str, raw_id: str) -> Found:
        """The response ``raw_id`` names, as it is now (ResponseNotFound: unknown, another
        owner's, deleted, expired, or a ``store: false`` one)."""
        ref = (await self.ids()).parse_response(raw_id)
        info = await self._conversations.info(ref.conversation_id, owner)
        if info is None and ref.run_id is None:
            raise ResponseNotFound()
        # A run may make its conversation (a background response on a new one): its own
        # record says whether the response is stored until then.
        found = await self._found(owner, raw_id, ref)
        if info is None:
            return found
        return replace(found, stored=info.stored_response, latest=info.revision)

    async def _found(self, owner: str, raw_id: str, ref: ResponseRef) -> Found:
        if ref.run_id is not None:
            return await self._found_by_run(owner, raw_id, ref)
        assert ref.revision is not None
        turn = await self._conversations.turn_at(ref.conversation_id, owner, ref.revision)
        run_id = (
            turn.turn_id
            if turn is not None
            else await self._runs.find(ref.conversation_id, owner, ref.revision - 1)
        )
        run = (
            await self._runs.view(run_id, owner, ref.conversation_id)
            if run_id is not None
            else None
        )
        if (turn is None and run is None) or (turn is not None and turn.response_deleted):
            raise ResponseNotFound()
        return Found(raw_id, ref.conversation_id, ref.revision if turn else None, turn, run)

    async def _found_by_run(self, owner: str, raw_id: str, ref: ResponseRef) -> Found:
        assert ref.run_id is not None
        run = await self._runs.view(ref.run_id, owner, ref.conversation_id)
        if run is None:
            raise ResponseNotFound()
        turn = None
        if run.revision is not None:
            turn = await self._conversations.turn_at(ref.conversation_id, owner, run.revision)
            if turn is None or turn.response_deleted:
                raise ResponseNotFound()
        return Found(raw_id, ref.conversation_id, run.revision, turn, run)

    async def cancel(self, owner: str, raw_id: str) -> Found:
        """Stop the response wherever it runs (a finished one stays as it is)."""
        found = await self.find(owner, raw_id)
        if found.run is not None and not found.run.finished:
            await self._runs.cancel(found.run.id, owner)
            return await self.find(owner, raw_id)
        return found

    async def delete(self, owner: str, raw_id: str, key: IdempotencyKey | None = None) -> None:
        """Forget the response: unknown from now on; its turn and items stay in a
        conversation of the client's (as on OpenAI). A stored response (its conversation is its
        own, never shown) that no other response of that conversation still holds goes with
        its conversation at once, and the latest of a stored chain has its turn's content
        erased: its input, output and transcript are readable nowhere. One still running is
        cancelled first. Through the write gate: a retry with the same
        Idempotency-Key is answered as the first attempt was."""

        async def write() -> None:
            found = await self.cancel(owner, raw_id)
            if found.stored and await self._alone(owner, found):
                await self._conversations.remove(found.conversation_id, owner, None, key)
                return
            if found.revision is not None:
                cid, revision = found.conversation_id, found.revision
                # The latest response of a stored chain: no later one holds its content.
                erase = (
                    found.stored
                    and (await self._conversations.describe(cid, owner)).revision == revision
                )
                await self._conversations.delete_response(cid, owner, revision, key, erase=erase)
            elif key is not None:  # nothing committed to forget: the key names nothing
                await self._turns.gate.release(key, in_doubt=False)
            if found.run is not None:
                await self._runs.forget(found.run.id, owner)

        async def deleted(_: Committed) -> None:
            return None

        if key is not None:  # the conversation it writes, recorded with its claim
            with suppress(ResponseNotFound):  # (named by no id: it writes none)
                key = key.writing((await self.ids()).parse_response(raw_id).conversation_id)
        await self._turns.gate.once(key, write, deleted)

    async def _alone(self, owner: str, found: Found) -> bool:
        """Whether ``found`` is the only response of its stored conversation not deleted (the
        others' turns may hold its items as their history)."""
        walked = self._conversations.walk(found.conversation_id, owner, newest_first=True)
        async with aclosing(walked) as turns:
            async for revision, turn in turns:
                if revision != found.revision and not turn.response_deleted:
                    return False
        return True

    async def replay(self, owner: str, raw_id: str) -> tuple[Found, AsyncGenerator[RunEvent, None]]:
        """A streamed response's events from the first, then live to its end (any replica,
        while they are kept). InvalidInput for a response that was not streamed."""
        found = await self.find(owner, raw_id)
        if found.run is None:
            raise InvalidInput("This response was not streamed: it has no events.", param="stream")
        return found, self._runs.events(found.run.id, owner, 0)

    async def turn_at(self, conversation_id: uuid.UUID, owner: str, revision: int) -> Turn:
        """A committed response's turn (its output, when a replayed stream reaches its
        end)."""
        turn = await self._conversations.turn_at(conversation_id, owner, revision)
        if turn is None:
            raise ResponseNotFound()
        return turn
