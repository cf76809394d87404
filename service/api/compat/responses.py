"""/v1/responses: a turn asked the OpenAI way (service/usecases/responses.py), answered as a
Response or as its event stream (stream.py renders the run of a streamed turn).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent

from service.api.bodies import strict
from service.api.compat import items as views
from service.api.compat.schemas import ResponseCreate, response_object
from service.api.compat.stream import ResponseStream
from service.api.correlation import correlation_id
from service.api.deps import Api, Caller
from service.api.errors import openai_documented
from service.api.headers import CORRELATION_ID, RETRY_AFTER, IdempotencyKey
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
from service.core.plans import TurnPlan

UNSUPPORTED = {
    "instructions": "instructions are not supported: the system prompt is the server's "
    "(SYSTEM_PROMPT), the same for every turn of the history",
    "background": "background responses are not supported yet on /v1 (use /api/v1)",
}


def check_fields(asked: ResponseCreate, model: str) -> None:
    """400 naming a field this server cannot honour, for any call."""
    for field, why in UNSUPPORTED.items():
        if getattr(asked, field) not in (None, False):
            raise InvalidInput(why + ".", param=field)
    if asked.model is not None and asked.model != model:
        raise InvalidInput(f"model: this server answers with {model!r} only.", param="model")
    views.includes(asked.include)


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
        idempotency_key: IdempotencyKey = None,
    ) -> Response[dict[str, Any]] | ServerSentEvent:
        asked, responses = data, api.responses
        check_fields(asked, responses.model)
        if asked.conversation is None and asked.previous_response_id is None:
            return Response(await stateless(asked, api))
        plan = await responses.plan(
            api.owner, input=asked.input, conversation=asked.conversation_id,
            previous_response_id=asked.previous_response_id, tools=asked.tools,
            truncation=asked.truncation, idempotency_key=idempotency_key,
            request=await request.body(),
        )  # fmt: skip
        chained = asked.previous_response_id is not None
        if asked.stream:
            return await stream(request, asked, plan, chained, api)
        started = time.time()
        done = await responses.run(plan, chained)
        assert done.revision is not None
        output = views.output_items(done.conversation_id, done.revision, done.items, done.inputs)
        return Response(response_object(
            done.conversation_id, done.revision, model=responses.model,
            status=done.status, output=output, incomplete_reason=done.incomplete_reason,
            created_at=started, truncation=asked.truncation,
        ))  # fmt: skip

    @get(
        "/{response_id:str}", summary="A committed response.",
        response_headers=[CORRELATION_ID], responses=openai_documented(ResponseNotFound),
    )  # fmt: skip
    async def retrieve(self, response_id: FromPath[str], api: Caller) -> dict[str, Any]:
        cid, revision, turn = await api.responses.retrieve(api.owner, response_id)
        first = input_count(turn.replay_items)
        output = views.output_items(cid, revision, turn.replay_items[first:], first)
        return response_object(
            cid, revision, model=turn.origin.model if turn.origin else "unknown",
            status=turn.status, output=output, incomplete_reason=turn.incomplete_reason,
            created_at=turn.created_at,
        )  # fmt: skip


async def stateless(asked: ResponseCreate, api: Api) -> dict[str, Any]:
    if asked.stream:
        raise InvalidInput("stream: not for calls without a conversation yet.", param="stream")
    started = time.time()
    reply = await api.responses.stateless(api.owner, asked.input, asked.tools)
    # Sealed reasoning is kept in the answer: a client that keeps the history has no other
    # copy to send back (OpenAI keeps it server-side; a store: false provider cannot).
    output = views.output_items(uuid.uuid4(), 1, reply.output_items, 0, encrypted=True)
    return response_object(
        None, None, rid=f"resp_{uuid.uuid4().hex}", model=api.responses.model,
        status=reply.status, output=output, incomplete_reason=reply.incomplete_reason,
        created_at=started, store=False,
    )  # fmt: skip


async def stream(
    request: Request[Any, Any, Any], asked: ResponseCreate, plan: TurnPlan, chained: bool, api: Api
) -> ServerSentEvent:
    cid = correlation_id(request.scope)
    started = await api.responses.stream(plan, chained, cid)
    run = started.run
    assert run is not None  # a run of its own: /v1 streams are never background (yet)
    rendering = ResponseStream(
        run, started.conversation_id, run.held.result() + 1, api.responses.model,
        asked.truncation,
    )  # fmt: skip
    return run_stream(api.runs, started, api.owner, rendering, request, api.sse_keepalive_s, {})
