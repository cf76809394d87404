"""What the controllers get injected (wired in service/app.py): singletons, no per-request
validation (the store types are Protocols)."""

from __future__ import annotations

from litestar.di import NamedDependency
from litestar.params import SkipValidation

from service.relay import Relay
from service.runs import TurnRuns
from service.store.base import ConversationStore, Operations
from service.turns import TurnService

Store = NamedDependency[SkipValidation[ConversationStore]]
Ops = NamedDependency[SkipValidation[Operations]]
Turns = NamedDependency[SkipValidation[TurnService]]
Runs = NamedDependency[SkipValidation[TurnRuns]]
Relayed = NamedDependency[SkipValidation[Relay]]
KeepaliveSeconds = NamedDependency[SkipValidation[float]]  # SSE_KEEPALIVE_S
Owner = NamedDependency[SkipValidation[str]]  # who is asking: from authentication (service/auth.py)
