"""What the controllers get injected (wired in service/app.py): who is asking and the use
cases, as one value, so a handler has one dependency. (Litestar resolves two or more in an
anyio task group per request: ~8% of a turn's server CPU, for singletons.) No per-request
validation: the store types are Protocols."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.di import NamedDependency
from litestar.params import SkipValidation

from service.store.ports import ConversationStore, Operations
from service.usecases.relay import Relay
from service.usecases.runs import TurnRuns
from service.usecases.turns import TurnService


@dataclass(frozen=True)
class Api:
    owner: str  # who is asking: from authentication (service/auth.py)
    store: ConversationStore
    turns: TurnService
    runs: TurnRuns
    relay: Relay
    sse_keepalive_s: float  # SSE_KEEPALIVE_S


Caller = NamedDependency[SkipValidation[Api]]
Ops = NamedDependency[SkipValidation[Operations]]
