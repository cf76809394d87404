"""``POST /v1/responses`` and what follows from it: a turn asked the OpenAI way.

A response is a committed turn of a conversation (service/core/ids.py). ``previous_response_id``
names where the turn goes: the latest response of its conversation continues it (under
If-Match, so a turn committed meanwhile makes it 400); an earlier one forks the conversation
there, and the turn runs on the fork (made by the turn's own commit). Without a conversation
and a previous response, the call is stateless: relayed to the provider, nothing kept.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from service.core import events
from service.core.errors import (
    Cancelled,
    ContentFiltered,
    InvalidInput,
    PreconditionFailed,
    RequestInProgress,
    ResponseNotFound,
)
from service.core.ids import parse_response_id
from service.core.items import client_tools, turn_input
from service.core.model import ForkPoint, Precondition, Turn
from service.core.plans import Asked, PlanRules, TurnPlan, make_plan
from service.providers.base import Reply
from service.usecases.conversations import Conversations
from service.usecases.relay import Relay
from service.usecases.runs import Started, TurnRuns
from service.usecases.turns import TurnDone, TurnService

NOT_LATEST = "previous_response_id must name the latest response of its conversation."


class Responses:
    def __init__(
        self,
        turns: TurnService,
        runs: TurnRuns,
        relay: Relay,
        conversations: Conversations,
        rules: PlanRules,
    ) -> None:
        self._turns, self._runs, self._relay = turns, runs, relay
        self._conversations, self._rules = conversations, rules

    @property
    def model(self) -> str:
        """The configured model: a request that names none gets it."""
        return self._turns.provider.origin.model

    @property
    def provider_name(self) -> str:
        return self._turns.provider.origin.provider

    @property
    def models(self) -> list[str]:
        """The models a request may name (besides any, with ``MODELS=*``)."""
        return [self.model, *sorted((self._rules.models or frozenset()) - {self.model})]

    def check_model(self, model: str) -> None:
        self._rules.check_model(model, self.model)

    def check(self, asked: Asked) -> None:
        """What any call may ask (400 naming the field otherwise), before anything else."""
        self._rules.check_model(asked.model, self.model)
        self._rules.check_instructions(asked.instructions)

    async def plan(
        self,
        owner: str,
        asked: Asked,
        *,
        input: str | list[Any],
        conversation: str | None,
        previous_response_id: str | None,
        tools: Sequence[Any] | None,
        truncation: str | None,
        if_match: Precondition,
        idempotency_key: str | None,
        request: bytes,
    ) -> TurnPlan:
        """The turn asked for (400 naming the field that cannot be honoured)."""
        fork: ForkPoint | None = None
        if previous_response_id is not None:
            if conversation is not None:
                raise InvalidInput(
                    "Send conversation or previous_response_id, not both.",
                    param="previous_response_id",
                )
            conversation, latest, fork = await self._chain(owner, previous_response_id)
            if_match = latest if if_match is None else if_match & latest
        assert conversation is not None  # without either, the call is stateless
        given = turn_input(input)
        return make_plan(
            self._rules, given.message, conversation, if_match, owner=owner,
            idempotency_key=idempotency_key, key_subject=request,  # a retry asks exactly this
            truncate=truncation != "disabled", items=given.items, said=given.said, fork_of=fork,
            client_tools=client_tools(tools, set(self._rules.own_tools)), asked=asked,
        )  # fmt: skip

    async def _chain(
        self, owner: str, response_id: str
    ) -> tuple[str, frozenset[int], ForkPoint | None]:
        cid, revision = parse_response_id(response_id)
        info = await self._conversations.info(cid, owner)
        if info is None or info.revision < revision:
            raise ResponseNotFound()
        fork = ForkPoint(cid, revision) if revision < info.revision else None
        return str(cid), frozenset({revision}), fork

    async def run(self, plan: TurnPlan, chained: bool) -> TurnDone:
        """The turn, committed (``chained``: its plan came from a previous_response_id)."""
        try:
            return await self._turns.run(plan)
        except PreconditionFailed as exc:
            raise _not_latest(exc, chained) from None

    async def stream(self, plan: TurnPlan, chained: bool, correlation_id: str) -> Started:
        """The turn as a run whose events the caller renders; it has taken its
        conversation's lease (or an Idempotency-Key retry names an earlier run): what fails
        before is raised here, for a JSON answer."""
        started = await self._runs.start(plan, correlation_id=correlation_id)
        run = started.run
        if run is None:  # an Idempotency-Key retry while the first attempt runs elsewhere
            raise RequestInProgress(turn_id=started.turn_id)
        try:
            await asyncio.shield(run.held)
        except PreconditionFailed as exc:
            raise _not_latest(exc, chained) from None
        except asyncio.CancelledError:
            run.stop(Cancelled(events.GONE))  # its client went away before its stream
            raise
        return started

    async def stateless(
        self, owner: str, asked: Asked, input: str | list[Any], tools: Sequence[Any] | None
    ) -> Reply:
        """A call without a conversation: relayed to the provider (store false), nothing
        kept."""
        given = input if isinstance(input, list) else [{"role": "user", "content": input}]
        resolved = await self._relay.resolve(owner, given)
        reply = await self._relay.respond(resolved, client_tools(tools, set()), asked)
        if reply.incomplete_reason == "content_filter":
            raise ContentFiltered()
        return reply

    async def retrieve(self, owner: str, response_id: str) -> tuple[uuid.UUID, int, Turn]:
        cid, revision = parse_response_id(response_id)
        turn = await self._conversations.turn_at(cid, owner, revision)
        if turn is None:
            raise ResponseNotFound()
        return cid, revision, turn


def _not_latest(exc: PreconditionFailed, chained: bool) -> Exception:
    return InvalidInput(NOT_LATEST, param="previous_response_id") if chained else exc
