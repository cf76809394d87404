"""POST /api/v1/chat and /api/v1/chat/stream: one use case, two ways to deliver it."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from service.api.correlation import correlation_id
from service.api.headers import (
    CONVERSATION_ID,
    CORRELATION_ID,
    ETAG,
    RETRY_AFTER,
    Config,
    IdempotencyKey,
    IfMatch,
    Owner,
    Turns,
    etag,
    parse_if_match,
)
from service.api.schemas import ChatRequest, ChatResponse, ErrorEnvelope
from service.api.sse import sse_events
from service.errors import InvalidInput
from service.strictjson import StrictJSONError, loads
from service.turns import TurnDone

_ERRORS = {
    status: ResponseSpec(ErrorEnvelope, description=text)
    for status, text in {
        400: "invalid_input or context_length_exceeded",
        401: "unauthorized",
        404: "conversation_not_found",
        409: "conversation_conflict or request_in_progress",
        412: "precondition_failed",
        413: "payload_too_large",
        422: "content_filtered or idempotency_key_reused",
        429: "rate_limited",
        500: "storage_error",
        502: "upstream_error",
        504: "upstream_timeout",
    }.items()
}


async def reject_duplicate_keys(request: Request[Any, Any, Any]) -> None:
    """msgspec keeps the last of duplicate keys; the contract rejects such bodies."""
    try:
        loads(await request.body())
    except StrictJSONError as exc:
        raise InvalidInput(f"The request body is not valid: {exc}.") from None


def chat_response(done: TurnDone, cid: str) -> Response[ChatResponse]:
    assert done.revision is not None
    body = ChatResponse(
        conversation_id=str(done.conversation_id),
        message=done.message,
        status="completed" if done.status == "completed" else "incomplete",
        incomplete_reason="max_output_tokens" if done.incomplete_reason else None,
        revision=done.revision,
        correlation_id=cid,
    )
    return Response(body, headers={"ETag": etag(done.revision)})


class ChatController(Controller):
    path = "/api/v1/chat"
    tags = ["chat"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @post(
        "/",
        status_code=200,
        before_request=reject_duplicate_keys,
        summary="Send a message; the turn is committed before the answer is returned.",
        response_headers=[ETAG, CORRELATION_ID, RETRY_AFTER],
        responses=_ERRORS,
    )
    async def chat(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatRequest], turns: Turns,
        owner: Owner, if_match: IfMatch = None, idempotency_key: IdempotencyKey = None,
    ) -> Response[ChatResponse]:  # fmt: skip
        plan = turns.plan(
            data.message, data.conversation_id, parse_if_match(if_match),
            owner=owner, idempotency_key=idempotency_key,
        )  # fmt: skip
        return chat_response(await turns.run(plan), correlation_id(request.scope))

    @post(
        "/stream",
        status_code=200,
        media_type="text/event-stream",
        before_request=reject_duplicate_keys,
        summary="Send a message and stream the reply as Server-Sent Events.",
        description="Events: message.delta {delta}, then exactly one of message.done "
        "{status, incomplete_reason, conversation_id, revision} or error {error}. "
        "Problems found before the stream starts are ordinary JSON errors.",
        response_headers=[CONVERSATION_ID, CORRELATION_ID, RETRY_AFTER],
        responses=_ERRORS,
    )
    async def stream(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatRequest], turns: Turns,
        settings: Config, owner: Owner, if_match: IfMatch = None,
        idempotency_key: IdempotencyKey = None,
    ) -> ServerSentEvent:  # fmt: skip
        plan = turns.plan(
            data.message, data.conversation_id, parse_if_match(if_match),
            owner=owner, idempotency_key=idempotency_key,
        )  # fmt: skip
        await turns.check(plan)
        events = sse_events(
            turns.events(plan, stream=True), correlation_id(request.scope), settings.sse_keepalive_s
        )
        return ServerSentEvent(events, headers={"X-Conversation-Id": str(plan.conversation_id)})
