"""The turn-commit use case, shared by the plain and the streaming chat endpoints.

lock -> load -> check If-Match -> call provider -> accept or reject the reply -> conditional
commit. Nothing is written before the reply is accepted, and the commit is one transaction
conditional on the revision read under the lock, so a stale writer in another replica gets
ConversationConflict and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from service import metrics
from service.context import Budget, SystemPrompt, turn_bytes, window_start
from service.errors import (
    ContentFiltered,
    ConversationNotFound,
    InvalidInput,
    StorageError,
    UpstreamError,
)
from service.exchange import Answer, Exchange, ToolCalled, Tooling
from service.locks import KeyedLocks
from service.model import ANONYMOUS, Conversation, Precondition, Turn
from service.plans import TurnPlan, check_precondition, make_plan
from service.providers.base import (
    Provider,
    Reply,
    TextDelta,
    is_sealed_reasoning,
    user_input_item,
)
from service.store.base import ConversationStore
from service.store.idempotency import IdempotencyStore

T = TypeVar("T")


@dataclass(frozen=True)
class TurnDone:
    conversation_id: uuid.UUID
    message: str
    status: str
    incomplete_reason: str | None
    revision: int | None  # None: nothing was committed (content filter)


TurnEvent = TextDelta | ToolCalled | TurnDone


class TurnService:
    def __init__(
        self,
        store: ConversationStore,
        provider: Provider,
        *,
        max_message_chars: int,
        system_prompt: SystemPrompt | None = None,
        budget: Budget | None = None,
        tooling: Tooling | None = None,
        idempotency: IdempotencyStore | None = None,
        locks: KeyedLocks | None = None,
    ) -> None:
        self.store = store
        self.provider = provider
        self.locks = locks or KeyedLocks()
        self._max_message_chars = max_message_chars
        self._prompt = system_prompt
        self._instructions = system_prompt.text if system_prompt else None
        self._budget = budget or Budget()
        self._tooling = tooling
        self._idempotency = idempotency

    def plan(
        self,
        message: str,
        conversation_id: str | None,
        if_match: Precondition,
        *,
        owner: str = ANONYMOUS,
        idempotency_key: str | None = None,
    ) -> TurnPlan:
        """Validate a request without I/O; a new conversation gets its id here."""
        if idempotency_key is not None and self._idempotency is None:
            raise InvalidInput("Idempotency-Key is not enabled on this server.")
        return make_plan(
            message,
            conversation_id,
            if_match,
            max_message_chars=self._max_message_chars,
            owner=owner,
            idempotency_key=idempotency_key,
        )

    async def check(self, plan: TurnPlan) -> None:
        """Fail early (before a stream starts) when the turn cannot succeed."""
        if not plan.is_new:
            await self._load(plan)
        if plan.idempotency is not None and self._idempotency is not None:
            await self._idempotency.check(plan.idempotency)

    async def run(self, plan: TurnPlan) -> TurnDone:
        """A non-streaming turn: the committed result, or a domain error."""
        done: TurnDone | None = None
        async for event in self.events(plan, stream=False):  # drained: the turn ends cleanly
            done = event if isinstance(event, TurnDone) else done
        if done is None:
            raise UpstreamError("The provider ended without a reply.")
        if done.revision is None:
            raise ContentFiltered()  # the only TurnDone without a commit
        return done

    async def events(self, plan: TurnPlan, *, stream: bool) -> AsyncGenerator[TurnEvent, None]:
        """The turn as events: text deltas, then one TurnDone. Closing the iterator early
        cancels the provider call and commits nothing (unless the commit already started).

        With an Idempotency-Key, a retry of a committed turn replays its result without
        calling the provider, and a turn that does not commit frees the key again."""
        key, keys = plan.idempotency, self._idempotency
        if key is None or keys is None:
            async with aclosing(self._turn(plan, stream)) as events:
                async for event in events:
                    yield event
            return
        stored = await keys.claim(key)
        if stored is not None:
            for event in _replay(stored, stream):
                yield event
            return
        committed = False
        try:
            async with aclosing(self._turn(plan, stream)) as events:
                async for event in events:
                    committed = isinstance(event, TurnDone) and event.revision is not None
                    yield event
        finally:
            if not committed:
                with contextlib.suppress(StorageError):  # the claim's lease runs out anyway
                    await _settle(keys.release(key))

    async def _turn(self, plan: TurnPlan, stream: bool) -> AsyncGenerator[TurnEvent, None]:
        mode = "stream" if stream else "chat"
        async with self.locks.hold(plan.conversation_id):
            with metrics.turn_outcome(mode):
                conversation = None if plan.is_new else await self._load(plan)
                user_item = user_input_item(plan.message)
                earlier = conversation.turns if conversation else []
                sendable = [self._sendable(turn) for turn in earlier]  # once per turn
                committed = conversation.context_start if conversation else 1
                start = self._window(committed, sendable, user_item, stream)
                window = earlier[start - 1 :]
                history = [item for items in sendable[start - 1 :] for item in items]
                exchange = Exchange(
                    self.provider,
                    lambda drop_all_sealed: _unsealed(window) if drop_all_sealed else history,
                    user_item,
                    instructions=self._instructions,
                    tooling=self._tooling,
                    stream=stream,
                    max_request_bytes=self._budget.max_request_bytes,
                )
                answer: Answer | None = None
                async with aclosing(exchange.events()) as exchange_events:
                    async for event in exchange_events:
                        if isinstance(event, Answer):
                            answer = event
                        else:
                            yield event
                if answer is None:
                    raise UpstreamError("The provider ended without a reply.")
                reply = answer.reply
                if reply.incomplete_reason == "content_filter":
                    metrics.TURNS_NOT_COMMITTED.labels(mode, ContentFiltered.code).inc()
                    yield _done(plan, reply, None)
                    return
                if not reply.text:
                    raise UpstreamError("The provider's reply was empty.")
                turn = Turn(
                    plan.message,
                    reply.text,
                    [user_item, *answer.items],
                    self.provider.origin,
                    start,
                    self._prompt.version if self._prompt else None,
                    answer.tool_calls,
                )
                expected = conversation.revision if conversation else 0
                done = _done(plan, reply, expected + 1)  # what the commit makes, if it succeeds
                key = plan.idempotency
                append = self.store.append(
                    plan.conversation_id,
                    turn,
                    expected,
                    owner=plan.owner,
                    idempotency=(key, _STORED.encode(done).decode()) if key else None,
                )
                with metrics.COMMIT_SECONDS.time():
                    commit = await _settle(append)
                metrics.TURNS_COMMITTED.labels(mode).inc()
                yield _done(plan, reply, commit.revision)

    def _window(
        self,
        committed: int,
        sendable: list[list[msgspec.Raw]],
        user_item: msgspec.Raw,
        stream: bool,
    ) -> int:
        """The first earlier turn to send (see service/context.py): never before the
        committed window start; only committed together with this turn."""
        sizes = [turn_bytes(items) for items in sendable]
        tools = self._tooling.definitions if self._tooling else None
        overhead = self.provider.request_overhead(self._instructions, tools, stream=stream)
        fixed = overhead + len(user_item)
        return window_start(sizes, committed, fixed, self._budget)

    def _sendable(self, turn: Turn) -> list[msgspec.Raw]:
        """A turn's replay items, verbatim, except sealed reasoning this provider cannot open:
        reasoning sealed by another provider, endpoint or model is left out."""
        if turn.origin is not None and turn.origin != self.provider.origin:
            return [item for item in turn.replay_items if not is_sealed_reasoning(item)]
        return turn.replay_items

    async def _load(self, plan: TurnPlan) -> Conversation:
        conversation = await self.store.load(plan.conversation_id)
        if conversation is None or conversation.owner != plan.owner:
            raise ConversationNotFound()  # another owner's conversation looks like no conversation
        check_precondition(plan.if_match, conversation.revision)
        return conversation


def _unsealed(turns: list[Turn]) -> list[msgspec.Raw]:
    """The turns' replay items without any sealed reasoning (the one retry's history)."""
    return [item for turn in turns for item in turn.replay_items if not is_sealed_reasoning(item)]


def _done(plan: TurnPlan, reply: Reply, revision: int | None) -> TurnDone:
    return TurnDone(
        plan.conversation_id, reply.text, reply.status, reply.incomplete_reason, revision
    )


_STORED = msgspec.json.Encoder()


def _replay(stored: str, stream: bool) -> list[TurnEvent]:
    """The committed result of an earlier attempt with the same Idempotency-Key."""
    done = msgspec.json.decode(stored, type=TurnDone)
    return [TextDelta(done.message), done] if stream else [done]


async def _settle(awaitable: Awaitable[T]) -> T:
    """Run a commit to its end even if the caller is cancelled meanwhile (a client that
    disconnects mid-commit): the transaction is then either fully committed or not at all,
    and the lock is not released while it is still in flight."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
