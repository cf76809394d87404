"""POST /api/v1/chat and /api/v1/chat/stream: one use case, two ways to deliver it."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from service.api.bodies import decode, decoded
from service.api.correlation import correlation_id
from service.api.deps import WriteApi, Writer
from service.api.errors import TURN_ERRORS, documented
from service.api.headers import (
    CONVERSATION_ID,
    CORRELATION_ID,
    ETAG,
    RETRY_AFTER,
    TURN_ID,
    with_etag,
)
from service.api.routes import Resource
from service.api.schemas import ChatRequest, ChatResponse, TurnAccepted
from service.api.sse import TurnEvents, run_stream
from service.core.errors import (
    InvalidInput,
    PayloadTooLarge,
    StorageError,
    Unauthorized,
)
from service.core.plans import TurnPlan, chat_request, make_plan
from service.usecases.runs import Started

_ERRORS = documented(InvalidInput, Unauthorized, PayloadTooLarge, StorageError, *TURN_ERRORS)


async def strict_chat_request(request: Request[Any, Any, Any]) -> None:
    """Before the framework parses the body (it would build Python objects of whatever came):
    a header given twice is ambiguous; the body must decode into ChatRequest, which msgspec
    checks in C as it reads (a hostile body is refused at its first wrong byte); and msgspec
    keeps the last of duplicate keys, which the contract refuses. That last check walks the
    body in Python, but by then it is a flat object of known fields: it costs next to
    nothing."""
    if len(request.headers.getall("idempotency-key", [])) > 1:
        raise InvalidInput("Idempotency-Key must be sent once.")
    decoded(request, decode(await request.body(), ChatRequest))  # the handler's data


class ChatController(Resource):
    path = "/api/v1/chat"

    @post(
        "/",
        status_code=200,
        before_request=strict_chat_request,
        summary="Send a message; the turn is committed before the answer is returned.",
        description='With "background": true the answer is 202 {turn_id, conversation_id, '
        "status} at once; the turn runs on (GET /api/v1/turns/{turn_id}).",
        response_headers=[ETAG, CORRELATION_ID, RETRY_AFTER],
        responses={202: ResponseSpec(TurnAccepted, description="background: started"), **_ERRORS},
    )
    async def chat(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ChatRequest],
        writer: Writer,
    ) -> Response[ChatResponse | TurnAccepted]:
        plan = chat_plan(writer, data)
        if data.background:
            return accepted(await writer.cases.runs.start(plan, correlation_id=cid(request)))
        body = ChatResponse.of(await writer.cases.turns.run(plan), cid(request))
        return with_etag(body, body.revision)

    @post(
        "/stream",
        status_code=200,
        media_type="text/event-stream",
        before_request=strict_chat_request,
        summary="Send a message and stream the reply as Server-Sent Events.",
        description="Events, each with an SSE id from 1: message.delta {delta}, tool.call "
        "{name, status}, then exactly one of message.done {status, incomplete_reason, "
        "conversation_id, revision, turn_id} or error {error}. Problems found before the "
        "stream starts are ordinary JSON errors. A client that drops resumes on any replica "
        "with GET /api/v1/turns/{X-Turn-Id}/events (Last-Event-ID); without "
        '"background": true, dropping the stream before the commit cancels the turn.',
        response_headers=[CONVERSATION_ID, TURN_ID, CORRELATION_ID, RETRY_AFTER],
        responses=_ERRORS,
    )
    async def stream(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ChatRequest],
        writer: Writer,
    ) -> ServerSentEvent:
        plan = chat_plan(writer, data)
        existing = await writer.cases.turns.check(plan, run=True)  # or in the run's creation
        started = await writer.cases.runs.start(
            plan, correlation_id=cid(request), existing=existing
        )
        headers = {
            "X-Conversation-Id": str(started.conversation_id),
            "X-Turn-Id": str(started.turn_id),
        }
        rendering = TurnEvents(cid(request))
        return run_stream(
            writer.cases.runs,
            started,
            writer.owner,
            rendering,
            request,
            writer.cases.sse_keepalive_s,
            headers,
        )


def chat_plan(writer: WriteApi, data: ChatRequest) -> TurnPlan:
    asked = chat_request(
        writer.owner,
        data.message,
        data.conversation_id,
        writer.precondition,
        idempotency_key=writer.idempotency_key,
        background=data.background,
        model=data.model,
    )
    return make_plan(writer.cases.rules, asked)


def cid(request: Request[Any, Any, Any]) -> str:
    return correlation_id(request.scope)


def accepted(started: Started) -> Response[ChatResponse | TurnAccepted]:
    body = TurnAccepted(str(started.turn_id), str(started.conversation_id), started.status)
    return Response(body, status_code=202)
