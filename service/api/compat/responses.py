"""/v1/responses: a turn asked the OpenAI way (service/usecases/responses.py), answered as a
Response or as its event stream (stream.py renders the run of a streamed turn).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent

from service.api.bodies import strict
from service.api.compat import items as views
from service.api.compat.items import ENCRYPTED
from service.api.compat.schemas import Echo, ResponseCreate, passed_through, response_object
from service.api.compat.stream import ResponseStream
from service.api.correlation import correlation_id
from service.api.deps import Api, Caller
from service.api.errors import openai_documented
from service.api.headers import (
    CORRELATION_ID,
    RETRY_AFTER,
    IdempotencyKey,
    IfMatch,
    parse_if_match,
)
from service.api.sse import run_stream
from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    ConversationConflict,
    ConversationNotFound,
    IdempotencyKeyReused,
    InvalidInput,
    PreconditionFailed,
    RateLimited,
    RequestInProgress,
    ResponseNotFound,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.items import input_count
from service.core.plans import Asked, TurnPlan

UNSUPPORTED = {
    "background": "background responses are not supported yet on /v1 (use /api/v1)",
    "context_management": "context_management is not supported yet",
}


def check_fields(asked: ResponseCreate) -> None:
    """400 naming a field this server cannot honour, for any call."""
    for field, why in UNSUPPORTED.items():
        if getattr(asked, field) not in (None, False):
            raise InvalidInput(why + ".", param=field)
    views.includes(asked.include)


def asked_of(
    asked: ResponseCreate, body: bytes, model: str, created_at: float
) -> tuple[Asked, Echo]:
    """What the request asks of the provider besides its input (the model, instructions, what
    to include, and every field turnstore does not interpret, as it came), and what its
    Response echoes (kept with the turn, with when it was created)."""
    fields = passed_through(body)
    echo = Echo(
        model=asked.model or model, instructions=asked.instructions, tools=asked.tools or (),
        truncation=asked.truncation, previous_response_id=asked.previous_response_id,
        store=asked.store is not False, background=bool(asked.background), fields=fields,
    )  # fmt: skip
    include = tuple(i for i in asked.include or () if i != ENCRYPTED)
    ask = Asked(asked.model, asked.instructions, fields, include, echo.record(created_at))
    return ask, echo


class OpenAIResponses(Controller):
    path = "/v1/responses"
    tags = ["openai"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @post(
        "/", status_code=200, summary="A turn: a Response, or (stream) its event stream.",
        description="A busy conversation is 400 conversation_locked, as OpenAI answers it.",
        before_request=strict(ResponseCreate), response_headers=[CORRELATION_ID, RETRY_AFTER],
        responses=openai_documented(
            ContextLengthExceeded, ConversationNotFound, ConversationConflict, RequestInProgress,
            PreconditionFailed, ContentFiltered, IdempotencyKeyReused, RateLimited, UpstreamError,
            UpstreamTimeout,
        ),
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
        ask, echo = asked_of(asked, body, responses.model, started)
        responses.check(ask)
        if asked.conversation is None and asked.previous_response_id is None:
            return Response(await stateless(asked, ask, echo, api, started))
        plan = await responses.plan(
            api.owner, ask, input=asked.input, conversation=asked.conversation_id,
            previous_response_id=asked.previous_response_id, tools=asked.tools,
            truncation=asked.truncation, if_match=parse_if_match(if_match),
            idempotency_key=idempotency_key, request=body,
        )  # fmt: skip
        chained = asked.previous_response_id is not None
        if asked.stream:
            return await stream(request, plan, chained, echo, started, api)
        done = await responses.run(plan, chained)
        assert done.revision is not None
        output = views.output_items(
            done.conversation_id, done.revision, done.items, done.inputs, own_calls=done.own_calls
        )
        return Response(response_object(
            done.conversation_id, done.revision, echo, status=done.status, output=output,
            incomplete_reason=done.incomplete_reason, created_at=started, usage=done.usage,
        ))  # fmt: skip

    @get(
        "/{response_id:str}", summary="A committed response.",
        response_headers=[CORRELATION_ID], responses=openai_documented(ResponseNotFound),
    )  # fmt: skip
    async def retrieve(self, response_id: FromPath[str], api: Caller) -> dict[str, Any]:
        cid, revision, turn = await api.responses.retrieve(api.owner, response_id)
        first = input_count(turn.replay_items)
        own = {call.call_id for call in turn.tool_calls}
        output = views.output_items(cid, revision, turn.replay_items[first:], first, own_calls=own)
        model = turn.origin.model if turn.origin else "unknown"
        echo, created_at = Echo.of_record(turn.response, model)
        return response_object(
            cid, revision, echo, status=turn.status, output=output,
            incomplete_reason=turn.incomplete_reason, created_at=created_at or turn.created_at,
            usage=turn.usage,
        )  # fmt: skip


async def stateless(
    asked: ResponseCreate, ask: Asked, echo: Echo, api: Api, started: float
) -> dict[str, Any]:
    if asked.stream:
        raise InvalidInput("stream: not for calls without a conversation yet.", param="stream")
    reply = await api.responses.stateless(api.owner, ask, asked.input, asked.tools)
    # Sealed reasoning is kept in the answer: a client that keeps the history has no other
    # copy to send back (OpenAI keeps it server-side; a store: false provider cannot).
    output = views.output_items(uuid.uuid4(), 1, reply.output_items, 0, encrypted=True)
    return response_object(
        None, None, replace(echo, store=False), rid=f"resp_{uuid.uuid4().hex}",
        status=reply.status, output=output, incomplete_reason=reply.incomplete_reason,
        created_at=started, usage=reply.usage,
    )  # fmt: skip


async def stream(
    request: Request[Any, Any, Any],
    plan: TurnPlan,
    chained: bool,
    echo: Echo,
    created_at: float,
    api: Api,
) -> ServerSentEvent:
    cid = correlation_id(request.scope)
    started = await api.responses.stream(plan, chained, cid)
    run = started.run
    assert run is not None  # a run of its own: /v1 streams are never background (yet)
    revision = run.held.result() + 1
    rendering = ResponseStream(run, started.conversation_id, revision, echo, created_at)
    return run_stream(api.runs, started, api.owner, rendering, request, api.sse_keepalive_s, {})
