"""/v1/responses: a turn asked the OpenAI way (service/usecases/responses.py), answered as a
Response or as its event stream (stream.py), and the response's life after it: retrieve (or
resume its stream), cancel, delete, its input items.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import ServerSentEvent

from service.api.bodies import strict
from service.api.compat import items as views
from service.api.compat.items import ENCRYPTED
from service.api.compat.schemas import (
    NOT_COUNTED,
    CompactCreate,
    ResponseCreate,
    TokensCount,
    compaction_object,
    passed_through,
    response_error,
    response_object,
)
from service.api.compat.stream import Output, Relayed, ResponseStream, Source
from service.api.correlation import correlation_id
from service.api.deps import Api, Caller
from service.api.errors import TURN_ERRORS, WRITE_ERRORS, openai_documented
from service.api.headers import (
    CORRELATION_ID,
    RETRY_AFTER,
    IdempotencyKey,
    IfMatch,
    parse_if_match,
)
from service.api.sse import (
    EventStream,
    closed_with_response,
    released_with_response,
    run_stream,
    sse_events,
)
from service.core.asks import Asked, Echo
from service.core.errors import (
    ConversationNotFound,
    InvalidInput,
    MethodNotAllowed,
    PreviousResponseNotFound,
    RateLimited,
    RequestInProgress,
    ResponseNotFound,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.ids import unstored_response_id
from service.core.items import input_count
from service.core.plans import TurnPlan
from service.usecases.responses import Found, Responses
from service.usecases.run import Run

Include = Annotated[
    list[str] | None,
    QueryParameter(name="include[]", required=False, description="reasoning.encrypted_content"),
]
Limit = Annotated[int, QueryParameter(ge=1, le=100, description="Items per page (1-100).")]
Order = Annotated[Literal["asc", "desc"], QueryParameter(description="Input order or reversed.")]
AfterItem = Annotated[str | None, QueryParameter(description="Items after this one (in order).")]
Streamed = Annotated[bool, QueryParameter(description="Replay its events, then follow it.")]
StartingAfter = Annotated[
    int | None,
    QueryParameter(ge=-1, le=2**31 - 1, description="Only the events after this sequence number."),
]


def check_fields(asked: ResponseCreate) -> None:
    """400 naming a field this server cannot honour, for any call."""
    if asked.store is False and (asked.background or asked.conversation is not None):
        what = "background" if asked.background else "conversation"
        raise InvalidInput(f"store: false cannot be used with {what}.", param="store")
    views.includes(asked.include)


def asked_of(
    asked: ResponseCreate, body: bytes, responses: Responses, created_at: float
) -> tuple[Asked, Echo]:
    """What the request asks of the provider besides its input (the model, instructions, what
    to include, when to compact, and every field turnstore does not interpret, as it came),
    and what its Response echoes (kept with the turn, with when it was created)."""
    fields = passed_through(body)
    compact = responses.compaction_asked(asked.context_management)
    if asked.store is False and asked.context_management is not None:
        # Nothing is kept to compact: the provider compacts, as OpenAI does with store false.
        fields["context_management"] = msgspec.Raw(msgspec.json.encode(asked.context_management))
    echo = Echo(
        model=asked.model or responses.model, instructions=asked.instructions,
        tools=asked.tools or (), truncation=asked.truncation,
        previous_response_id=asked.previous_response_id, store=asked.store is not False,
        background=bool(asked.background), fields=fields,
    )  # fmt: skip
    include = tuple(i for i in asked.include or () if i != ENCRYPTED)
    ask = Asked(
        asked.model, asked.instructions, fields, include,
        tools=responses.client_tools(asked.tools), truncate=asked.truncation != "disabled",
        compact=compact, echo=echo, created_at=created_at,
    )  # fmt: skip
    return ask, echo


class OpenAIResponses(Controller):
    path = "/v1/responses"
    tags = ["openai"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @post(
        "/", status_code=200, summary="A response: a Response, or (stream) its event stream.",
        description="A busy conversation is 400 conversation_locked, as OpenAI answers it.",
        before_request=strict(ResponseCreate), response_headers=[CORRELATION_ID, RETRY_AFTER],
        responses=openai_documented(*TURN_ERRORS, PreviousResponseNotFound),
    )  # fmt: skip
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ResponseCreate],
        api: Caller,
        if_match: IfMatch = None,
        idempotency_key: IdempotencyKey = None,
    ) -> Response[dict[str, Any]] | ServerSentEvent:
        asked, responses, body = data, api.responses, await request.body()
        check_fields(asked)
        started = time.time()  # the Response's created_at, the same in every answer about it
        ask, echo = asked_of(asked, body, responses, started)
        responses.check(ask)
        if asked.store is False:  # a relay: nothing is written, also after a stored response
            return await stateless(request, asked, ask, echo, api, started)
        plan = await responses.plan(
            api.owner, ask, input=asked.input, conversation=asked.conversation_id,
            previous_response_id=asked.previous_response_id, if_match=parse_if_match(if_match),
            idempotency_key=idempotency_key, background=bool(asked.background), body=body,
        )  # fmt: skip
        chained = asked.previous_response_id is not None
        echo = replace(echo, stored=plan.stored_response)  # known once planned
        encrypted = encrypted_asked(asked)
        if asked.stream or asked.background:
            streamed = bool(asked.stream)
            return await run_of(request, plan, chained, echo, started, streamed, encrypted, api)
        done = await responses.run(plan, chained)
        assert done.revision is not None
        output = Output.of_done(done).shown(api.ids, done.conversation_id, done.revision, encrypted)
        rid = api.ids.response(done.conversation_id, done.revision)
        return Response(response_object(
            done.conversation_id, echo, rid=rid, status=done.status, output=output,
            incomplete_reason=done.incomplete_reason, created_at=started, usage=done.usage,
        ))  # fmt: skip

    @post(
        "/compact", status_code=200,
        summary="The provider's compaction of a history (input and/or previous_response_id).",
        description="Relayed as OpenAI serves it: items turnstore showed are restored to their "
        "stored bytes first; nothing is kept.",
        before_request=strict(CompactCreate), response_headers=[CORRELATION_ID],
        responses=openai_documented(
            PreviousResponseNotFound, ResponseNotFound, RateLimited, UpstreamError, UpstreamTimeout
        ),
    )  # fmt: skip
    async def compact(self, data: JSONBody[CompactCreate], api: Caller) -> dict[str, Any]:
        responses = api.responses
        responses.check_model(data.model)
        asked = Asked(data.model, data.instructions)
        compacted = await responses.compact(api.owner, asked, data.input, data.previous_response_id)
        return compaction_object(compacted.items, compacted.usage)

    @post(
        "/input_tokens", status_code=200,
        summary="How many input tokens a create with this body would send.",
        description="Counted by the provider's own endpoint, stored items restored and the "
        "window applied; nothing is kept.",
        response_headers=[CORRELATION_ID],
        responses=openai_documented(
            PreviousResponseNotFound, ConversationNotFound, RateLimited, UpstreamError,
            UpstreamTimeout,
        ),
    )  # fmt: skip
    async def input_tokens(
        self, request: Request[Any, Any, Any], data: JSONBody[TokensCount], api: Caller
    ) -> dict[str, Any]:
        responses = api.responses
        fields = passed_through(await request.body())
        fields = {name: value for name, value in fields.items() if name not in NOT_COUNTED}
        asked = Asked(data.model, data.instructions, fields)
        responses.check(asked)
        counted = await responses.count_tokens(
            api.owner, asked, data.input, data.tools, conversation=data.conversation_id,
            previous=data.previous_response_id,
        )  # fmt: skip
        return {"object": "response.input_tokens", "input_tokens": counted}

    @get(
        "/{response_id:str}", summary="A response as it is now, or (stream) its events.",
        response_headers=[CORRELATION_ID],
        responses=openai_documented(ResponseNotFound, MethodNotAllowed),
    )  # fmt: skip
    async def retrieve(
        self,
        request: Request[Any, Any, Any],
        response_id: FromPath[str],
        api: Caller,
        include: Include = None,
        stream: Streamed = False,
        starting_after: StartingAfter = None,
    ) -> dict[str, Any] | ServerSentEvent:
        encrypted = views.includes(include)
        if stream:
            return await resumed(request, response_id, starting_after, api)
        return shown(await api.responses.find(api.owner, response_id), api, encrypted=encrypted)

    @post(
        "/{response_id:str}/cancel", status_code=200, summary="Stop a response wherever it runs.",
        response_headers=[CORRELATION_ID], responses=openai_documented(ResponseNotFound),
    )  # fmt: skip
    async def cancel(self, response_id: FromPath[str], api: Caller) -> dict[str, Any]:
        return shown(await api.responses.cancel(api.owner, response_id), api)

    @delete(
        "/{response_id:str}", status_code=200, summary="Forget a response (its turn stays).",
        response_headers=[CORRELATION_ID],
        responses=openai_documented(ResponseNotFound, MethodNotAllowed, *WRITE_ERRORS),
    )  # fmt: skip
    async def remove(
        self, response_id: FromPath[str], api: Caller, idempotency_key: IdempotencyKey = None
    ) -> dict[str, Any]:
        key = api.key(idempotency_key, "v1.responses.delete", response_id)
        await api.responses.delete(api.owner, response_id, key)
        return {"id": response_id, "object": "response", "deleted": True}

    @get(
        "/{response_id:str}/input_items", summary="The items a response was asked with.",
        response_headers=[CORRELATION_ID], responses=openai_documented(ResponseNotFound),
    )  # fmt: skip
    async def input_items(
        self,
        response_id: FromPath[str],
        api: Caller,
        include: Include = None,
        after: AfterItem = None,
        limit: Limit = 20,
        order: Order = "desc",
    ) -> dict[str, Any]:
        encrypted = views.includes(include)
        found = await api.responses.find(api.owner, response_id)
        shown_items: list[dict[str, Any]] = []
        if found.turn is not None and found.revision is not None:
            turn = found.turn
            inputs = turn.replay_items[: input_count(turn.replay_items)]
            own = {call.call_id for call in turn.tool_calls}
            shown_items = views.output_items(
                api.ids, found.conversation_id, found.revision, inputs, 0, encrypted=encrypted,
                own_calls=own,
            )  # fmt: skip
        return views.page(shown_items, after=after, limit=limit, order=order).body()


def encrypted_asked(asked: ResponseCreate) -> bool:
    return ENCRYPTED in (asked.include or ())


def shown(found: Found, api: Api, *, encrypted: bool = False) -> dict[str, Any]:
    """The Response of a response as it is now: its committed turn's, or its run's status."""
    turn, run = found.turn, found.run
    echo, created_at = _echo(found, api)
    if turn is not None and found.revision is not None:
        output = Output.of_turn(turn).shown(
            api.ids, found.conversation_id, found.revision, encrypted
        )
        return response_object(
            found.conversation_id, echo, rid=found.id, status=turn.status, output=output,
            incomplete_reason=turn.incomplete_reason, usage=turn.usage,
            created_at=created_at or turn.created_at, completed_at=turn.created_at,
        )  # fmt: skip
    assert run is not None  # a response not committed is one that runs, or ran, as a run
    body = response_object(
        found.conversation_id, echo, rid=found.id, status=run.status,
        created_at=created_at or run.created_at,
    )  # fmt: skip
    if run.error_code is not None:
        body["error"] = response_error(run.error_code, run.error_message or "")
    return body


def _echo(found: Found, api: Api) -> tuple[Echo, float | None]:
    """What a response echoes, and when it was created (None: an /api/v1 turn's)."""
    turn = found.turn
    model = turn.origin.model if turn is not None and turn.origin else api.responses.model
    echo, created_at = Echo.of_record(found.response, model)
    return replace(echo, stored=echo.stored or found.stored), created_at


def source_of(api: Api, cid: uuid.UUID, run: Run | None, run_id: uuid.UUID) -> Source:
    """Where a response's stream finds what its events do not hold: this process's own run
    while it runs here, else what the store recorded."""

    async def message_id() -> str | None:
        if run is not None:
            return run.message_id
        view = await api.runs.view(run_id, api.owner)
        return view.message_id if view is not None else None

    async def output(revision: int) -> Output:
        done = run.result if run is not None else None
        if done is not None and done.revision == revision:
            return Output.of_done(done)
        return Output.of_turn(await api.responses.turn_at(cid, api.owner, revision))

    async def revision() -> int | None:
        """The revision its turn makes: one past the one it holds its conversation at."""
        held = run.held if run is not None else None
        if held is not None and held.done() and not held.cancelled() and not held.exception():
            return held.result() + 1
        view = await api.runs.view(run_id, api.owner)
        return (
            view.base_revision + 1 if view is not None and view.base_revision is not None else None
        )

    return Source(message_id, output, revision)


async def run_of(
    request: Request[Any, Any, Any],
    plan: TurnPlan,
    chained: bool,
    echo: Echo,
    created_at: float,
    streamed: bool,
    encrypted: bool,
    api: Api,
) -> Response[dict[str, Any]] | ServerSentEvent:
    """A response that runs as a run: its stream, or (background, not streamed) its Response
    at once, queued."""
    started = await api.responses.stream(plan, chained, correlation_id(request.scope))
    run = started.run
    if run is None and not plan.background:  # a retry of a run that runs (or ran) elsewhere
        raise RequestInProgress(turn_id=started.turn_id)
    held = run.held.result() if run is not None and not plan.background else None
    rid = api.responses.id_of(api.ids, plan, started, None if held is None else held + 1)
    if not streamed:
        body = response_object(
            started.conversation_id, echo, rid=rid, status=started.status,
            created_at=created_at,
        )  # fmt: skip
        return Response(body)
    source = source_of(api, started.conversation_id, run, started.turn_id)
    rendering = ResponseStream(
        rid, started.conversation_id, echo, created_at, ids=api.ids, source=source,
        encrypted=encrypted,
    )  # fmt: skip
    return run_stream(api.runs, started, api.owner, rendering, request, api.sse_keepalive_s, {})


async def resumed(
    request: Request[Any, Any, Any], response_id: str, starting_after: int | None, api: Api
) -> ServerSentEvent:
    """A streamed response's events again, from the start (or after ``starting_after``),
    then live to its end: the same events with the same numbers on any replica."""
    found, events = await api.responses.replay(api.owner, response_id)
    assert found.run is not None
    released_with_response(request.scope, api.runs.reader(api.owner))  # or a JSON 429
    echo, created_at = _echo(found, api)
    run = api.runs.live(found.run.id, api.owner)
    source = source_of(api, found.conversation_id, run, found.run.id)
    rendering = ResponseStream(
        found.id, found.conversation_id, echo,
        created_at or (found.run.created_at.timestamp() if found.run.created_at else time.time()),
        ids=api.ids, source=source, starting_after=starting_after,
    )  # fmt: skip
    cid = correlation_id(request.scope)
    stream = sse_events(events, rendering, api.sse_keepalive_s, correlation_id=cid, follower=True)
    closed_with_response(request.scope, stream)
    return EventStream(stream)


async def stateless(
    request: Request[Any, Any, Any],
    asked: ResponseCreate,
    ask: Asked,
    echo: Echo,
    api: Api,
    started: float,
) -> Response[dict[str, Any]] | ServerSentEvent:
    """A ``store: false`` call: relayed, nothing kept; its id names nothing."""
    echo, rid = replace(echo, store=False), unstored_response_id()
    previous = asked.previous_response_id
    if asked.stream:
        # Its place among the owner's running turns (or a JSON 429), held to the stream's end.
        released_with_response(request.scope, await api.responses.place(api.owner))
        provider = await api.responses.stateless_stream(
            api.owner, ask, asked.input, asked.tools, previous
        )
        rendering = Relayed(ResponseStream(rid, None, echo, started, ids=api.ids))
        cid = correlation_id(request.scope)
        stream = sse_events(
            provider, rendering, api.sse_keepalive_s, correlation_id=cid, follower=False
        )
        closed_with_response(request.scope, stream)
        return EventStream(stream)
    reply = await api.responses.stateless(api.owner, ask, asked.input, asked.tools, previous)
    # Sealed reasoning is kept in the answer: a client that keeps the history has no other
    # copy to send back (OpenAI keeps it server-side; a store: false provider cannot).
    output = views.output_items(api.ids, None, 1, reply.output_items, 0, encrypted=True)
    return Response(response_object(
        None, echo, rid=rid, status=reply.status, output=output,
        incomplete_reason=reply.incomplete_reason, created_at=started, usage=reply.usage,
    ))  # fmt: skip
