"""The turn-commit use case, shared by every way a turn is asked for.

lease (and load) -> check If-Match -> window -> exchange with the provider -> accept or reject
the reply -> conditional commit (releasing the lease). Nothing is written before the reply is
accepted, and the commit is one transaction conditional on the revision read with the lease,
so a stale writer in another replica gets ConversationConflict and writes nothing.

An Idempotency-Key is claimed once, through the write gate (service/usecases/write_gate.py), by
whoever starts the turn (``claim``: ``run`` for a plain turn, service/usecases/runs.py for a
run), completed by the commit and freed here when the turn does not commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import msgspec

from service.core.asks import Asked
from service.core.errors import (
    CompactionUnsupported,
    ContentFiltered,
    ContextLengthExceeded,
    ConversationNotFound,
    InvalidInput,
    StorageError,
    TurnstoreError,
    UpstreamError,
)
from service.core.items import (
    calls_made,
    compaction_item,
    function_outputs,
    input_count,
    open_calls,
)
from service.core.model import (
    Append,
    Committed,
    Conversation,
    ReplyStatus,
    RunCommit,
    Turn,
    plain,
)
from service.core.plans import TurnPlan, check_precondition
from service.core.sizes import SizeLimit, turn_bytes
from service.core.strictjson import is_encodable
from service.core.usage import Usage, added
from service.core.window import Budget, SystemPrompt, Window, choose_window, instructions_for
from service.platform import metrics, tracing
from service.providers.base import (
    ItemDone,
    Provider,
    ProviderRequest,
    TextDelta,
    request_overhead,
)
from service.store.ports import Reads
from service.usecases import compaction
from service.usecases.exchange import (
    Answer,
    Exchange,
    ProviderAsk,
    ToolCalled,
    Tooling,
    advertised,
    tool_names,
)
from service.usecases.leases import Held, Leases
from service.usecases.locks import settle
from service.usecases.paging import held_bytes
from service.usecases.write_gate import WriteGate, doubtful


@dataclass(frozen=True)
class TurnDone:
    conversation_id: uuid.UUID
    message: str
    status: ReplyStatus
    incomplete_reason: str | None
    revision: int | None  # None: nothing was committed (content filter)
    items: Sequence[msgspec.Raw] = ()  # the reply's output items, as committed
    inputs: int = 1  # how many input items precede them in the turn
    usage: Usage | None = None  # of the turn's provider calls, added up
    model: str | None = None  # that made the reply
    own_calls: frozenset[str] = frozenset()  # the call ids of turnstore's own tools' calls
    compaction: msgspec.Raw | None = None  # the compaction item the turn ran on, if it made one


TurnEvent = ItemDone | TextDelta | ToolCalled | TurnDone


class DurableRun(Protocol):
    """A turn running as a run (service/usecases/run.py): its commit also ends the run. It
    holds its place among its owner's running turns, and its lease, as ``id``."""

    id: uuid.UUID

    async def begin(self, revision: int, *, written: bool = False) -> None:
        """The turn holds its conversation at ``revision`` (0: a new one; it queued until
        now): if it commits, it makes ``revision + 1``. (A run writes it while the provider
        call starts, and waits for it before the turn's first event or its commit;
        ``written``: the lease's statement wrote it, Held.begun.)"""

    async def prepare_commit(self, turn: Turn) -> RunCommit: ...


class TurnService:
    def __init__(
        self,
        reads: Reads,
        provider: Provider,
        *,
        leases: Leases,
        system_prompt: SystemPrompt | None = None,
        budget: Budget | None = None,
        tooling: Tooling | None = None,
        gate: WriteGate | None = None,
        size_limit: SizeLimit | None = None,
    ) -> None:
        self._reads = reads
        self.provider = provider
        self.leases = leases
        self._prompt = system_prompt
        self._budget = budget or Budget()
        self._tooling = tooling
        self.gate = gate or WriteGate(None)
        self._size = size_limit or SizeLimit()

    @property
    def prompt(self) -> SystemPrompt | None:
        return self._prompt

    @property
    def tool_names(self) -> frozenset[str]:
        """The names of turnstore's own tools (TOOLS): no client tool may take them."""
        return self._tooling.registry.names() if self._tooling else frozenset()

    async def check(self, plan: TurnPlan, *, run: bool = False) -> bool:
        """Fail early (before a stream starts) when the turn cannot succeed: an unknown
        conversation, a failed If-Match, an Idempotency-Key used with another request, the
        owner's write budget spent. The turn checks them again (under its lease, in its claim,
        before its provider call).

        ``run``: the turn starts as a run next (Runs.start), whose creation can check its
        conversation in the same statement (NewRun.existing); True when that check is left to
        it: without an Idempotency-Key (whose check comes after the conversation's)."""
        self.gate.budget.check(plan.owner, sum(map(len, plan.input_items)))
        left = run and not plan.is_new and plan.idempotency is None
        if not plan.is_new and not left:
            info = await self._reads.describe(plan.conversation_id, plan.owner)
            if info is None:
                raise ConversationNotFound()
            check_precondition(plan.if_match, info.revision)
        await self.gate.check(plan.idempotency)  # a run's retry follows it (runs.py)
        return left

    async def claim(self, plan: TurnPlan, turn_id: uuid.UUID | None = None) -> Committed | None:
        """Claim the plan's Idempotency-Key for this attempt (``turn_id``: its run); where an
        earlier attempt committed, if one did. Raises RequestInProgress while an earlier
        attempt runs, IdempotencyKeyReused when the key came with another request."""
        key = plan.idempotency and plan.idempotency.writing(plan.conversation_id)
        return await self.gate.claim(key, turn_id)

    async def run(self, plan: TurnPlan) -> TurnDone:
        """A non-streaming turn: the committed result, or a domain error."""
        committed = await self.claim(plan)
        done: TurnDone | None = None
        events = self.events(plan, stream=False, committed=committed)
        async for event in events:  # drained: the turn ends cleanly
            done = event if isinstance(event, TurnDone) else done
        assert done is not None  # a turn ends with TurnDone or raises
        if done.revision is None:
            raise ContentFiltered()  # the only TurnDone without a commit
        return done

    async def events(
        self,
        plan: TurnPlan,
        *,
        stream: bool,
        run: DurableRun | None = None,
        committed: Committed | None = None,
    ) -> AsyncGenerator[TurnEvent, None]:
        """The turn as events: text deltas, then one TurnDone. Closing the iterator early
        cancels the provider call and commits nothing (unless the commit already started).

        ``committed``: the plan's Idempotency-Key names an earlier commit (see ``claim``): its
        result is replayed without calling the provider. Otherwise a turn with a key that
        does not commit frees it again. A ``run`` is ended by the commit, in its
        transaction."""
        if committed is not None:
            async with aclosing(self._replay(plan, committed, stream, run)) as replayed:
                async for event in replayed:
                    yield event
            return
        committing, in_doubt = False, False  # (ended without a commit: none was tried)
        try:
            async with aclosing(self._turn(plan, stream, run)) as events:
                async for event in events:
                    committing = isinstance(event, TurnDone) and event.revision is not None
                    yield event
        except BaseException as failure:
            in_doubt = doubtful(failure)
            raise
        finally:
            if committing:
                self.gate.settled(plan.idempotency)
            else:
                await self.release(plan, in_doubt=in_doubt)
                if plan.fork_of is not None:  # it made no fork: its place is given back
                    with contextlib.suppress(StorageError):  # it leaves the minute anyway
                        await settle(self.leases.free_fork(plan.owner, plan.conversation_id))

    async def release_run(self, turn_id: uuid.UUID, owner: str) -> None:
        """A run that ended without its commit (its replica vanished) frees its key."""
        await self.gate.release_run(turn_id, owner)

    async def release(self, plan: TurnPlan, *, in_doubt: bool = True) -> None:
        """A turn that did not commit does not use its Idempotency-Key up (``in_doubt``:
        WriteGate.release)."""
        await self.gate.release(plan.idempotency, in_doubt=in_doubt)

    async def _turn(
        self, plan: TurnPlan, stream: bool, run: DurableRun | None
    ) -> AsyncGenerator[TurnEvent, None]:
        mode = "stream" if stream else "chat"
        asked = self._request(plan, stream)
        # What ends the turn before its TurnDone is counted; what it takes of its owner's write
        # budget is given back unless it commits.
        with metrics.turn_outcome(mode), contextlib.ExitStack() as budget:
            async with self.leases.hold(plan, run.id if run else None, asked.origin) as held:
                conversation = held.conversation or await self._fork_basis(plan)
                if conversation is not None:
                    check_precondition(plan.if_match, conversation.revision)
                new_items = plan.input_items
                if plan.input.items:  # a client's function outputs must answer its open calls
                    check_answers(new_items, conversation)
                held_size = await self._held(plan, conversation)
                # Full before the provider is called, if the input alone passes the limit; and
                # the owner's write budget admits the input (and what a fork copies) first.
                adding = sum(map(len, new_items))
                self._size.check(held_size or 0, adding)
                copied = (held_size or 0) if plan.fork_of is not None else 0
                spend = budget.enter_context(self.gate.budget.spending(plan.owner, copied + adding))
                if plan.fork_of is not None:  # its place among the owner's forks, taken now
                    await self.leases.take_fork(plan.owner, plan.conversation_id)
                window = self._window(conversation, [*new_items, *plan.client_tools], asked)
                if plan.asked and not plan.asked.truncate and window.start > 1:
                    raise ContextLengthExceeded(
                        "The conversation no longer fits the model's context, and truncation "
                        "is disabled."
                    )
                if run is not None:
                    at = conversation.revision if conversation else 0
                    await run.begin(at, written=held.begun)
                window, spent = await self._compacted(plan, conversation, window, new_items, asked)
                if stream and (made := compaction_item(window.compacted)) is not None:
                    yield ItemDone(made)  # its Response's first output item, announced first
                answer: Answer | None = None
                exchange_of = self._exchange(window, new_items, plan, asked, stream)
                async with aclosing(exchange_of) as exchange:
                    async for event in exchange:
                        if isinstance(event, Answer):
                            answer = event
                        else:
                            yield event
                assert answer is not None  # an exchange ends with its Answer or raises
                if spent is not None:  # a compaction ran first: its cost is the turn's too
                    answer = dataclasses.replace(answer, usage=added(spent, answer.usage))
                turn = self._accept(plan, window, new_items, answer, asked)
                revision = None
                if turn is not None:
                    size = self._stored_with(held_size, turn)
                    revision = await self._commit(plan, conversation, held, turn, run, size)
                    spend(copied + turn_bytes(turn))
            metrics.turn_ended(mode, committed=revision is not None)
        # Outside the outcome count: a client leaving now does not undo the commit.
        compacted_by = compaction_item(window.compacted) if window.compacted else None
        yield _done(plan, answer, revision, len(new_items), asked.origin.model, compacted_by)

    async def history(
        self, cid: uuid.UUID, owner: str, revision: int, model: str | None
    ) -> list[msgspec.Raw]:
        """What a turn after ``revision`` would send of the conversation's earlier turns (for
        ``model``), as of that revision: its window, compacted context first. Only the turns
        of the window that turn ``revision`` was sent with (and that turn) are read."""
        turns, start = await self._window_before(cid, owner, revision)
        origin = self.provider.origin_for(model)
        return choose_window(turns, start, origin, 0, self._budget).items

    async def _window_before(
        self, cid: uuid.UUID, owner: str, revision: int
    ) -> tuple[list[Turn], int]:
        """Turns ``start``..``revision`` of the conversation, where ``start`` is the window
        start of turn ``revision`` (no later window starts before it), read by their range,
        and ``start``. ConversationNotFound when there is no such turn of the owner's."""
        if revision < 1:
            return [], 1
        last = await self._reads.turn(cid, owner, revision)
        if last is None:
            raise ConversationNotFound()
        start = min(last.context_from, revision)
        earlier = await self._reads.turns(
            cid, owner, start, revision - 1, newest_first=False, limit=revision - start
        )
        return [*(turn for _, turn in earlier), last], start

    async def compact(self, plan: TurnPlan) -> tuple[int, Usage | None]:
        """A compaction committed on its own (core.plans.compaction_plan): the window as a
        turn would send it, compacted, as a turn without messages at the next revision. The
        revision it made, and what it cost (an Idempotency-Key retry: the first attempt's)."""

        async def compacted(done: Committed) -> tuple[int, Usage | None]:
            cid, revision = done.turn
            turn = await self._reads.turn(cid, plan.owner, revision)
            if turn is None:
                raise ConversationNotFound()  # deleted or expired since
            return revision, turn.usage

        key = plan.idempotency and plan.idempotency.writing(plan.conversation_id)
        return await self.gate.once(key, lambda: self._compact(plan), compacted)

    async def _compact(self, plan: TurnPlan) -> tuple[int, Usage | None]:
        asked = self._request(plan, stream=False)
        async with (
            self.leases.hold(plan, origin=asked.origin) as held,
            contextlib.AsyncExitStack() as budget,
        ):
            conversation = held.conversation
            if conversation is None:
                raise ConversationNotFound()
            check_precondition(plan.if_match, conversation.revision)
            window = self._window(conversation, [], asked)
            if not window.items:
                raise InvalidInput("The conversation has nothing to compact.")
            # Unless in debt, before the provider is called.
            spend = budget.enter_context(self.gate.budget.spending(plan.owner, 0))
            making = conversation.revision + 1
            compacted = await compaction.compact(self.provider, window, asked.template, making)
            turn = Turn(
                user_message="",
                assistant_message="",
                replay_items=[],
                transcript=(),
                origin=asked.origin,
                context_from=making,
                usage=compacted.usage,
                prompt_version=asked.prompt.version if asked.prompt else None,
                compacted=compacted.window.compacted,
            )
            size = self._stored_with(await self._held(plan, conversation), turn)
            revision = await self._commit(plan, conversation, held, turn, None, size)
            spend(turn_bytes(turn))
        return revision, compacted.usage

    async def _compacted(
        self,
        plan: TurnPlan,
        conversation: Conversation | None,
        window: Window,
        new_items: list[msgspec.Raw],
        asked: ProviderAsk,
    ) -> tuple[Window, Usage | None]:
        """The window compacted first when the turn's input passes its threshold
        (service/usecases/compaction.py), and what the compaction cost."""
        if not compaction.due(plan.compact_threshold, conversation, window, new_items):
            return window, None
        making = (conversation.revision if conversation else 0) + 1
        try:
            compacted = await compaction.compact(self.provider, window, asked.template, making)
        except CompactionUnsupported:
            if plan.asked is not None and plan.asked.compact is not None:
                raise  # the client asked for it (context_management)
            return window, None  # CONTEXT_STRATEGY=compact: the whole-turn window, as drop
        return compacted.window, compacted.usage

    def _request(self, plan: TurnPlan, stream: bool) -> ProviderAsk:
        ask = plan.asked or Asked()
        prompt = instructions_for(self._prompt, ask.instructions, server_first=plan.server_prompt)
        template = ProviderRequest(
            [],
            prompt.text if prompt else None,
            advertised(self._tooling, ask.tools),
            plan.model,
            ask.fields,
            ask.include,
        )
        overhead = request_overhead(self.provider.origin.model, template, stream=stream)
        origin = self.provider.origin_for(plan.model)
        client_names = tool_names(ask.tools)
        return ProviderAsk(prompt, origin, template, overhead, client_names, plan.asked is not None)

    def _window(
        self, conversation: Conversation | None, new_items: list[msgspec.Raw], asked: ProviderAsk
    ) -> Window:
        """The earlier turns to send (service/core/window.py): never before the committed
        window start; only committed together with this turn."""
        fixed = asked.overhead + sum(map(len, new_items))
        if conversation is None:  # a new one
            return choose_window([], 1, asked.origin, fixed, self._budget)
        # Never before the first turn held: a read that stopped going back (the bytes a
        # request can carry) holds no turn before it.
        start = max(conversation.context_start, conversation.first)
        return choose_window(conversation.turns, start, asked.origin, fixed, self._budget)

    async def _held(self, plan: TurnPlan, conversation: Conversation | None) -> int | None:
        """What the conversation holds before this turn (MAX_CONVERSATION_BYTES), from the
        size its row stores as the lease read it (a fork's: its source's turns up to the fork
        point); what that leaves uncounted is counted a page at a time (usecases/paging.py)
        and kept by this turn's commit. None: not counted (there is no limit to check)."""
        if conversation is None:
            return 0
        if self._size.max_bytes is None and (
            plan.fork_of is None or self.gate.budget.per_minute is None
        ):
            return None  # no limit asks (a fork's copy counts against the write budget)
        point = plan.fork_of
        cid = point.source if point is not None else plan.conversation_id
        return await held_bytes(self._reads, cid, plan.owner, conversation.revision, conversation)

    def _stored_with(self, held: int | None, turn: Turn) -> int | None:
        """The conversation's size with ``turn`` (None: not counted), or ConversationFull."""
        return None if held is None else self._size.check(held, turn_bytes(turn))

    def _exchange(
        self,
        window: Window,
        new_items: list[msgspec.Raw],
        plan: TurnPlan,
        asked: ProviderAsk,
        stream: bool,
    ) -> AsyncGenerator[ItemDone | TextDelta | ToolCalled | Answer, None]:
        exchange = Exchange(
            self.provider,
            window,
            new_items,
            asked,
            tooling=self._tooling,
            stream=stream,
            max_request_bytes=self._budget.max_request_bytes,
        )
        return exchange.events()

    def _accept(
        self,
        plan: TurnPlan,
        window: Window,
        new_items: list[msgspec.Raw],
        answer: Answer,
        asked: ProviderAsk,
    ) -> Turn | None:
        """The turn to commit, or None when the reply was filtered (nothing commits)."""
        reply = answer.reply
        if reply.incomplete_reason == "content_filter":
            return None
        if not reply.text and not answer.client_calls:
            raise UpstreamError("The provider's reply was empty.")
        if "\x00" in reply.text or not is_encodable(reply.text):
            raise UpstreamError("The provider's reply holds text that cannot be stored.")
        said = (*plan.input_said, ("assistant", reply.text))
        derived = said == plain(plan.message, reply.text)
        return Turn(
            user_message=plan.message,
            assistant_message=reply.text,
            replay_items=[*new_items, *answer.items],
            transcript=None if derived else said,
            response=plan.response,
            origin=asked.origin,
            context_from=window.start,
            prompt_version=asked.prompt.version if asked.prompt else None,
            tool_calls=answer.tool_calls,
            status=reply.status,
            incomplete_reason=reply.incomplete_reason,
            usage=answer.usage,
            compacted=window.compacted,
        )

    async def _fork_basis(self, plan: TurnPlan) -> Conversation | None:
        """A forked turn's history as the fork will hold it: the window of the source's turn
        at the fork point, read by its range (the source's earlier turns are not read)."""
        point = plan.fork_of
        if point is None:
            return None
        source = await self._reads.describe(point.source, plan.owner)
        if source is None:
            raise ConversationNotFound()
        if source.revision < point.revision:
            raise InvalidInput("The fork point is not a revision of the conversation.")
        turns, start = await self._window_before(point.source, plan.owner, point.revision)
        return Conversation(
            plan.conversation_id,
            point.revision,
            source.created_at,
            source.updated_at,
            turns,
            context_start=start,
            owner=plan.owner,
            first=start,
            stored_bytes=source.stored_bytes,
            stored_revision=source.stored_revision,
            rewritten_at=source.rewritten_at,
        )

    async def _commit(
        self,
        plan: TurnPlan,
        conversation: Conversation | None,
        held: Held,
        turn: Turn,
        run: DurableRun | None,
        stored_bytes: int | None,
    ) -> int:
        ending = await run.prepare_commit(turn) if run else None
        append = self.leases.commit(
            Append(
                conversation_id=plan.conversation_id,
                turn=turn,
                expected_revision=conversation.revision if conversation else 0,
                owner=plan.owner,
                idempotency=plan.idempotency,
                lease=held.holder,
                run=ending,
                fork_of=plan.fork_of,
                stored_response=plan.stored_response,
                stored_bytes=stored_bytes,
            )
        )
        with metrics.COMMIT_SECONDS.time(), tracing.span("turn.commit") as span:
            try:
                commit = await settle(append)
            except TurnstoreError as exc:
                span.set_attribute("turnstore.outcome", exc.code)
                raise
            span.set_attributes(
                {"turnstore.outcome": "committed", "turnstore.revision": commit.revision}
            )
        held.committed = True  # the commit released the lease
        return commit.revision

    async def _replay(
        self, plan: TurnPlan, committed: Committed, stream: bool, run: DurableRun | None
    ) -> AsyncGenerator[TurnEvent, None]:
        """The committed result of an earlier attempt with the same Idempotency-Key."""
        cid, revision = committed.turn
        turn = await self._reads.turn(cid, plan.owner, revision)
        if turn is None:
            raise ConversationNotFound()  # deleted or expired since
        if run is not None:
            await run.begin(revision - 1)
        first = input_count(turn.replay_items)
        if stream:
            yield TextDelta(turn.assistant_message)
        yield TurnDone(
            conversation_id=cid,
            message=turn.assistant_message,
            status=turn.status,
            incomplete_reason=turn.incomplete_reason,
            revision=revision,
            items=turn.replay_items[first:],
            inputs=first,
            usage=turn.usage,
            model=turn.origin.model if turn.origin else None,
            own_calls=frozenset(call.call_id for call in turn.tool_calls),
            compaction=compaction_item(turn.compacted),
        )


def check_answers(new_items: list[msgspec.Raw], conversation: Conversation | None) -> None:
    """Function outputs a client sends must answer calls its last turn left open, or calls
    it sends itself (the history a client restores into a stored response)."""
    answered = {call.call_id for call in function_outputs(new_items)}
    if not answered:
        return
    latest = conversation.last if conversation else None
    last = latest.replay_items if latest else []
    if not answered <= open_calls(last) | calls_made(new_items):
        raise InvalidInput(
            "input: a function_call_output answers no open function call of this conversation.",
            param="input",
        )


def _done(
    plan: TurnPlan,
    answer: Answer,
    revision: int | None,
    inputs: int,
    model: str,
    compaction: msgspec.Raw | None,
) -> TurnDone:
    reply = answer.reply
    return TurnDone(
        conversation_id=plan.conversation_id,
        message=reply.text,
        status=reply.status,
        incomplete_reason=reply.incomplete_reason,
        revision=revision,
        items=answer.items,
        inputs=inputs,
        usage=answer.usage,
        model=model,
        own_calls=frozenset(call.call_id for call in answer.tool_calls),
        compaction=compaction,
    )
