"""What the controllers get injected (wired in service/app.py, built here): who is asking and
the use cases, as one value, so a handler has one dependency. (Litestar resolves two or more in
an anyio task group per request: ~8% of a turn's server CPU, for singletons.) A write that
honours If-Match takes ``Writer`` in place of ``Caller``: the same value with the write's two
headers, which its provider reads (so OpenAPI documents them on exactly those routes, and
Litestar validates them as a handler's own). No per-request validation of the rest: the use
cases are plain classes behind SkipValidation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.di import NamedDependency, Provide
from litestar.params import SkipValidation

from service.api import headers
from service.core.ids import Ids
from service.core.model import IdempotencyKey, Precondition
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


@dataclass(frozen=True)
class WriteApi(Api):
    """The caller of a write that honours If-Match, with the write's two headers as sent."""

    request: Request[Any, Any, Any]
    if_match: str | None
    idempotency_key: str | None

    @property
    def precondition(self) -> Precondition:
        return headers.parse_if_match(self.if_match)

    def keyed(self, route: str, *subject: str | bytes) -> IdempotencyKey | None:
        """Its Idempotency-Key (None: none), bound as ``key`` binds one."""
        return self.key(self.idempotency_key, route, *subject)

    async def body_keyed(self, route: str, *subject: str) -> IdempotencyKey | None:
        """Its Idempotency-Key bound to ``subject`` and the request's body."""
        return self.keyed(route, *subject, await self.request.body())


Owner = Callable[[Request[Any, Any, Any]], Awaitable[str]]


def providers(owner: Owner, cases: UseCases) -> dict[str, Provide]:
    """The two ways to be injected, ``api`` (Caller) and ``writer`` (Writer): a route asks for
    one of them, so a request resolves one dependency either way."""

    async def api(request: Request[Any, Any, Any]) -> Api:
        return Api(await owner(request), cases, await cases.ids.get())

    async def writer(
        request: Request[Any, Any, Any],
        if_match: headers.IfMatch = None,
        idempotency_key: headers.IdempotencyKey = None,
    ) -> WriteApi:
        caller = await owner(request)  # first, as for ``api``: a stranger learns nothing more
        ids = await cases.ids.get()
        return WriteApi(caller, cases, ids, request, if_match, idempotency_key)

    return {"api": Provide(api), "writer": Provide(writer)}


Caller = NamedDependency[SkipValidation[Api]]
Writer = NamedDependency[SkipValidation[WriteApi]]
Ops = NamedDependency[SkipValidation[Operations]]
