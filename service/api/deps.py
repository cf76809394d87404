"""What the controllers get injected (wired in service/app.py): who is asking and the use
cases, as one value, so a handler has one dependency. (Litestar resolves two or more in an
anyio task group per request: ~8% of a turn's server CPU, for singletons.) No per-request
validation: the use cases are plain classes behind SkipValidation."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.di import NamedDependency
from litestar.params import SkipValidation

from service.core.ids import Ids
from service.core.model import IdempotencyKey
from service.core.plans import PlanRules
from service.store.ports import Operations
from service.usecases.conversations import Conversations
from service.usecases.kept_responses import KeptResponses
from service.usecases.responses import Responses
from service.usecases.runs import TurnRuns
from service.usecases.secret_ids import IdsSource
from service.usecases.turns import TurnService
from service.usecases.write_gate import WriteGate


@dataclass(frozen=True)
class UseCases:
    """The use cases, built once by the wiring."""

    turns: TurnService
    runs: TurnRuns
    conversations: Conversations
    responses: Responses  # a /v1 response asked
    kept: KeptResponses  # and its life after it
    rules: PlanRules  # what a request may ask
    sse_keepalive_s: float  # SSE_KEEPALIVE_S
    gate: WriteGate  # what every write passes through
    ids: IdsSource  # the deployment's own ids (service/core/ids.py)


@dataclass(frozen=True)
class Api:
    owner: str  # who is asking: from authentication (service/api/auth.py)
    cases: UseCases
    ids: Ids  # the ids this deployment shows and reads back

    def key(self, header: str | None, route: str, *subject: str | bytes) -> IdempotencyKey | None:
        """The Idempotency-Key a write came with (None: none), bound to its ``route`` and what a
        retry must repeat (its path's ids, its body)."""
        return self.cases.gate.key(self.owner, header, route, *subject)


Caller = NamedDependency[SkipValidation[Api]]
Ops = NamedDependency[SkipValidation[Operations]]
