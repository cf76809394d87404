"""``POST /v1/responses`` and what follows from it: a turn asked the OpenAI way, and the
response's life after it (retrieve, resume, cancel, delete, its input items).

A response is a turn (service/core/ids.py). ``previous_response_id`` names where the turn goes:
the latest response of its conversation continues it (under If-Match, so a turn committed
meanwhile makes it 400); an earlier one forks the conversation there, and the turn runs on the
fork (made by the turn's own commit). Without a conversation and a previous response the
response is *stored* (as OpenAI's ``store`` defaults to): its input and output become the
first turn of a new conversation of the caller's, which expires STORED_RESPONSE_TTL_DAYS after
its last turn; with ``store: false`` nothing is kept (a relay). A streamed or background
response runs as a durable turn (service/usecases/runs.py): its events can be read again,
from any replica, for TURN_EVENTS_TTL_S after it ends.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from service.core import events
from service.core.asks import Asked
from service.core.errors import (
    Cancelled,
    CompactionUnsupported,
    ContentFiltered,
    InvalidInput,
    PreconditionFailed,
    PreviousResponseNotFound,
    ResponseNotFound,
)
from service.core.ids import Ids, parse_conversation_id
from service.core.items import check_history, client_tools, turn_input, user_input_item
from service.core.model import ForkPoint, Precondition
from service.core.plans import PlanRules, TurnPlan, TurnRequest, make_plan
from service.providers.base import Compacted, ProviderEvent, Reply
from service.usecases.conversations import Conversations
from service.usecases.kept_responses import Found, KeptResponses
from service.usecases.relay import Relay
from service.usecases.restore import Restorer
from service.usecases.runs import Started, TurnRuns
from service.usecases.turns import TurnDone, TurnService

NOT_LATEST = "previous_response_id must name the latest response of its conversation."


@dataclass(frozen=True)
class Unkept:
    """A ``store: false`` call, whole or streamed: whose it is, what it asks, its input, and
    the stored response whose history goes first (None: none)."""

    owner: str
    asked: Asked
    input: str | list[Any]
    previous: str | None = None


class Responses:
    def __init__(
        self,
        turns: TurnService,
        runs: TurnRuns,
        relay: Relay,
        restorer: Restorer,
        conversations: Conversations,
        rules: PlanRules,
        kept: KeptResponses,
    ) -> None:
        self._turns, self._runs, self._relay, self._restorer = turns, runs, relay, restorer
        self._conversations, self._rules, self._kept = conversations, rules, kept

    @property
    def model(self) -> str:
        """The configured model: a request that names none gets it."""
        return self._turns.provider.origin.model

    def served_by(self, model: str) -> str:
        """The name of the provider a request for ``model`` goes to."""
        return self._turns.provider.origin_for(model).provider

    @property
    def models(self) -> list[str]:
        """The models a request may name (besides any, with ``MODELS=*``)."""
        return [self.model, *sorted((self._rules.models or frozenset()) - {self.model})]

    def compaction_asked(self, entries: Sequence[Any] | None) -> int | None:
        """The compaction threshold a ``context_management`` asks for (400 naming it if
        malformed; None: none asked)."""
        return self._rules.compaction_asked(entries)

    def check_model(self, model: str) -> None:
        self._rules.check_model(model)

    def client_tools(self, tools: Sequence[Any] | None, relayed: bool) -> tuple[msgspec.Raw, ...]:
        """The function tools a client offers (400 for one it may not: see client_tools): a
        relayed call (nothing kept, turnstore runs no tool in it) may name one like turnstore's
        own."""
        return client_tools(tools, set() if relayed else set(self._rules.own_tools))

    def check(self, asked: Asked) -> None:
        """What any call may ask (400 naming the field otherwise), before anything else."""
        self._rules.check_model(asked.model)
        self._rules.check_instructions(asked.instructions)
        if asked.compact is not None and not self._turns.provider.compacts(asked.model):
            raise CompactionUnsupported()  # context_management, of a provider that cannot

    # --- a turn asked -------------------------------------------------------------------------

    async def plan(
        self,
        owner: str,
        asked: Asked,
        input: str | list[Any],
        *,
        conversation: str | None,
        previous_response_id: str | None,
        if_match: Precondition,
        idempotency_key: str | None,
        body: bytes,
    ) -> TurnPlan:
        """The turn asked for (400 naming the field that cannot be honoured): on
        ``conversation``, after ``previous_response_id``, or (neither) a stored response's
        turn on a new conversation."""
        fork: ForkPoint | None = None
        stored = conversation is None and previous_response_id is None
        where: uuid.UUID | str | None = conversation  # as sent, or the chain's (a UUID)
        if previous_response_id is not None:
            if conversation is not None:
                raise InvalidInput(
                    "Send conversation or previous_response_id, not both.",
                    param="previous_response_id",
                )
            found, latest, fork = await self._chain(owner, previous_response_id)
            where, stored = found.conversation_id, found.stored
            if_match = latest if if_match is None else if_match & latest
        given = turn_input(input)
        if isinstance(input, list):  # items shown by turnstore come back as they are stored
            if where is None:  # a new stored response's history has a user message
                check_history(input)
            origin = self._relay.origin(asked.model)
            items = await self._restorer.restore(owner, input, origin=origin)
            given = replace(given, items=tuple(items))
        request = TurnRequest(
            owner,
            where,
            given,
            if_match,
            idempotency_key,
            key_subject=body,  # a retry asks exactly this
            background=asked.background,
            fork_of=fork,
            asked=asked,
            stored_response=stored,
        )
        return make_plan(self._rules, request)

    async def _chain(
        self, owner: str, previous: str
    ) -> tuple[Found, frozenset[int], ForkPoint | None]:
        """Where a turn after ``previous`` goes: its conversation, the revision it must still
        be at, and the fork to make when a later turn committed since."""
        found, revision = await self._completed(owner, previous)
        latest = found.latest  # read with it: the conversation row is read once before the lease
        if latest is None:
            latest = (await self._conversations.describe(found.conversation_id, owner)).revision
        fork = ForkPoint(found.conversation_id, revision) if revision < latest else None
        return found, frozenset({revision}), fork

    async def _completed(self, owner: str, previous: str) -> tuple[Found, int]:
        """The completed response ``previous`` names and the revision its turn made."""
        try:
            found = await self._kept.find(owner, previous)
        except ResponseNotFound:
            raise PreviousResponseNotFound() from None
        if found.revision is None:
            raise InvalidInput(
                "previous_response_id names a response that has not completed.",
                param="previous_response_id",
            )
        return found, found.revision

    async def run(self, plan: TurnPlan, chained: bool) -> TurnDone:
        """The turn, committed (``chained``: its plan came from a previous_response_id)."""
        try:
            return await self._turns.run(plan)
        except PreconditionFailed as exc:
            raise _not_latest(exc, chained) from None

    async def stream(self, plan: TurnPlan, chained: bool, correlation_id: str) -> Started:
        """The turn as a run whose events the caller renders. A background one is answered
        at once; any other once it has taken its conversation's lease: what fails before is
        raised here, for a JSON answer. An Idempotency-Key retry names the earlier run."""
        started = await self._runs.start(plan, correlation_id=correlation_id)
        run = started.run
        if run is None or plan.background:
            return started
        try:
            await asyncio.shield(run.held)
        except PreconditionFailed as exc:
            raise _not_latest(exc, chained) from None
        except asyncio.CancelledError:
            run.stop(Cancelled(events.GONE))  # its client went away before its stream
            raise
        return started

    async def stateless(self, call: Unkept) -> Reply:
        """A ``store: false`` call: relayed to the provider, nothing kept (after its
        ``previous``: its stored history, read, then its ``input``)."""
        async with self._turns.leases.placed(call.owner):  # a provider call: counted as a turn
            resolved = await self._relayed_input(call)
            reply = await self._relay.respond(resolved, call.asked)
        if reply.incomplete_reason == "content_filter":
            raise ContentFiltered()
        return reply

    async def stateless_stream(self, call: Unkept) -> AsyncGenerator[ProviderEvent, None]:
        """A ``store: false`` call, streamed: the provider's events as they come. The caller
        holds a place among the owner's running turns for it (``place``)."""
        resolved = await self._relayed_input(call)
        return self._relay.stream(list(resolved), call.asked)

    async def _relayed_input(self, call: Unkept) -> list[msgspec.Raw]:
        """What a ``store: false`` call sends: its history (``previous``'s window as a turn
        after it would send it, read and never written), then its input, restored."""
        owner, asked, input, previous = call.owner, call.asked, call.input, call.previous
        given = input if isinstance(input, list) else [{"role": "user", "content": input}]
        if previous is None:
            return await self._relay.resolve(owner, given, asked.model)
        found, revision = await self._completed(owner, previous)
        history = await self._turns.history(found.conversation_id, owner, revision, asked.model)
        turn_input(given)  # each item checked, as a chained turn's
        origin = self._relay.origin(asked.model)
        return [*history, *await self._restorer.restore(owner, given, origin=origin)]

    async def compact(
        self, owner: str, asked: Asked, input: str | list[Any] | None, previous: str | None
    ) -> Compacted:
        """``POST /v1/responses/compact``: the history ``previous`` names (its window as of it)
        and ``input`` (restored as a stateless call's), compacted by the provider; nothing is
        kept."""
        items: list[msgspec.Raw] = []
        if previous is not None:
            found, revision = await self._completed(owner, previous)
            items = await self._turns.history(found.conversation_id, owner, revision, asked.model)
        if input:
            listed = input if isinstance(input, list) else [{"role": "user", "content": input}]
            turn_input(listed)  # each item checked, as a create's (the provider never sees one bad)
            origin = self._relay.origin(asked.model)
            items += await self._restorer.restore(owner, listed, origin=origin)
        if not items:
            raise InvalidInput("Send input or previous_response_id to compact.", param="input")
        async with self._turns.leases.placed(owner):  # a provider call: counted as a turn
            return await self._relay.compact(items, asked)

    async def count_tokens(
        self,
        owner: str,
        asked: Asked,
        input: str | list[Any] | None,
        *,
        conversation: str | None,
        previous: str | None,
    ) -> int:
        """``POST /v1/responses/input_tokens``: the input tokens the create with this body
        would send (the history of ``conversation`` or ``previous`` as its window holds it for
        the model, then ``input``, restored), counted by the provider; nothing is kept."""
        if conversation is not None and previous is not None:
            raise InvalidInput(
                "Send conversation or previous_response_id, not both.",
                param="previous_response_id",
            )
        history: list[msgspec.Raw] = []
        if previous is not None:
            found, revision = await self._completed(owner, previous)
            history = await self._turns.history(found.conversation_id, owner, revision, asked.model)
        elif conversation is not None:
            cid = parse_conversation_id(conversation)
            latest = (await self._conversations.describe(cid, owner)).revision
            if latest:
                history = await self._turns.history(cid, owner, latest, asked.model)
        given: list[msgspec.Raw] = []
        if isinstance(input, str):
            given = [user_input_item(input)]
        elif input is not None:
            turn_input(input)  # each item checked, as a create's
            origin = self._relay.origin(asked.model)
            given = await self._restorer.restore(owner, input, origin=origin)
        if not history and not given:
            raise InvalidInput("Send input, conversation or previous_response_id.", param="input")
        async with self._turns.leases.placed(owner):  # a provider call: counted as a turn
            return await self._relay.count([*history, *given], asked)

    async def place(self, owner: str) -> Callable[[], Awaitable[None]]:
        """A place among ``owner``'s running turns for a provider call outside a turn (a
        streamed stateless call), or TooManyRequests; what gives it back."""
        return await self._turns.leases.place(owner)

    @staticmethod
    def id_of(ids: Ids, plan: TurnPlan, started: Started, revision: int | None) -> str:
        """The id a response of ``plan`` is shown by: the revision it makes, or (a background
        response, shown before its turn holds the conversation) its run. In the conversation
        the run holds: an Idempotency-Key retry's plan names a new one of its own."""
        if plan.background or revision is None:
            return ids.run_response(started.conversation_id, started.turn_id)
        return ids.response(started.conversation_id, revision)


def _not_latest(exc: PreconditionFailed, chained: bool) -> Exception:
    return InvalidInput(NOT_LATEST, param="previous_response_id") if chained else exc
