"""How a /v1 response asked is answered (service/api/compat/responses.py): a Response once
its turn commits, its event stream while it runs (as a run: durable, any replica), at once
when it runs in the background, or, for a ``store: false`` call, relayed with nothing kept."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from litestar import Request, Response
from litestar.response import ServerSentEvent

from service.api.compat import item_views as views
from service.api.compat.commands import encrypted_asked
from service.api.compat.objects import ResponseCreate, response_object
from service.api.compat.stream import Output, Relayed, ResponseStream, Source
from service.api.correlation import correlation_id
from service.api.deps import Api
from service.api.sse import (
    EventStream,
    closed_with_response,
    released_with_response,
    run_stream,
    sse_events,
)
from service.core.asks import Asked, Echo
from service.core.errors import RequestInProgress
from service.core.ids import unstored_response_id
from service.core.plans import TurnPlan
from service.providers.base import Reply
from service.usecases.responses import Unkept
from service.usecases.run import Run
from service.usecases.turns import TurnDone


async def answered(
    request: Request[Any, Any, Any], plan: TurnPlan, asked: ResponseCreate, ask: Asked, api: Api
) -> Response[dict[str, Any]] | ServerSentEvent:
    """A stored response's answer: its Response once committed, or it runs as a run."""
    assert ask.echo is not None
    chained = asked.previous_response_id is not None
    echo = replace(ask.echo, stored=plan.stored_response)  # known once planned
    encrypted = encrypted_asked(asked)
    if asked.stream or asked.background:
        return await run_of(request, plan, chained, echo, bool(asked.stream), encrypted, api)
    done = await api.cases.responses.run(plan, chained)
    assert done.revision is not None
    output = Output.of_done(done).shown(api.ids, done.conversation_id, done.revision, encrypted)
    rid = api.ids.response(done.conversation_id, done.revision)
    return ended(done.conversation_id, echo, rid, done, output)


def ended(
    cid: uuid.UUID | None, echo: Echo, rid: str, end: TurnDone | Reply, output: list[dict[str, Any]]
) -> Response[dict[str, Any]]:
    """The Response of a call that ended (its turn committed, or a relayed reply)."""
    body = response_object(
        cid,
        echo,
        rid=rid,
        status=end.status,
        output=output,
        incomplete_reason=end.incomplete_reason,
        usage=end.usage,
    )
    return Response(body)


def source_of(api: Api, cid: uuid.UUID, run: Run | None, run_id: uuid.UUID) -> Source:
    """Where a response's stream finds what its events do not hold: this process's own run
    while it runs here, else what the store recorded."""

    async def message_id() -> str | None:
        if run is not None:
            return run.message_id
        view = await api.cases.runs.view(run_id, api.owner)
        return view.message_id if view is not None else None

    async def output(revision: int) -> Output:
        done = run.result if run is not None else None
        if done is not None and done.revision == revision:
            return Output.of_done(done)
        return Output.of_turn(await api.cases.kept.turn_at(cid, api.owner, revision))

    async def revision() -> int | None:
        """The revision its turn makes: one past the one it holds its conversation at."""
        held = run.held if run is not None else None
        if held is not None and held.done() and not held.cancelled() and not held.exception():
            return held.result() + 1
        view = await api.cases.runs.view(run_id, api.owner)
        return (
            view.base_revision + 1 if view is not None and view.base_revision is not None else None
        )

    return Source(message_id, output, revision)


async def run_of(
    request: Request[Any, Any, Any],
    plan: TurnPlan,
    chained: bool,
    echo: Echo,
    streamed: bool,
    encrypted: bool,
    api: Api,
) -> Response[dict[str, Any]] | ServerSentEvent:
    """A response that runs as a run: its stream, or (background, not streamed) its Response
    at once, queued."""
    started = await api.cases.responses.stream(plan, chained, correlation_id(request.scope))
    run = started.run
    if run is None and not plan.background:  # a retry of a run that runs (or ran) elsewhere
        raise RequestInProgress(turn_id=started.turn_id)
    held = run.held.result() if run is not None and not plan.background else None
    rid = api.cases.responses.id_of(api.ids, plan, started, None if held is None else held + 1)
    if not streamed:
        return Response(
            response_object(started.conversation_id, echo, rid=rid, status=started.status)
        )
    source = source_of(api, started.conversation_id, run, started.turn_id)
    rendering = ResponseStream(
        rid,
        started.conversation_id,
        echo,
        ids=api.ids,
        source=source,
        encrypted=encrypted,
    )
    return run_stream(
        api.cases.runs, started, api.owner, rendering, request, api.cases.sse_keepalive_s, {}
    )


async def stateless(
    request: Request[Any, Any, Any], asked: ResponseCreate, ask: Asked, api: Api
) -> Response[dict[str, Any]] | ServerSentEvent:
    """A ``store: false`` call: relayed, nothing kept; its id names nothing."""
    assert ask.echo is not None
    echo, rid = replace(ask.echo, store=False), unstored_response_id()
    call = Unkept(api.owner, ask, asked.input, asked.previous_response_id)
    if asked.stream:
        # Its place among the owner's running turns (or a JSON 429), held to the stream's end.
        released_with_response(request.scope, await api.cases.responses.place(api.owner))
        provider = await api.cases.responses.stateless_stream(call)
        rendering = Relayed(ResponseStream(rid, None, echo, ids=api.ids))
        cid = correlation_id(request.scope)
        stream = sse_events(
            provider, rendering, api.cases.sse_keepalive_s, correlation_id=cid, follower=False
        )
        closed_with_response(request.scope, stream)
        return EventStream(stream)
    reply = await api.cases.responses.stateless(call)
    # Sealed reasoning is kept in the answer: a client that keeps the history has no other
    # copy to send back (OpenAI keeps it server-side; a store: false provider cannot).
    output = views.output_items(api.ids, None, 1, reply.output_items, 0, encrypted=True)
    return ended(None, echo, rid, reply, output)
