"""/v1/responses: a turn asked the OpenAI way, answered as a Response or as its event stream.

A response is a committed turn of a conversation (see ids.py). What a request may ask is
checked before anything else happens (``plan_of``); the turn itself runs under the same rules
as on /api/v1: lease, If-Match, Idempotency-Key, the commit before the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent

from service.api.bodies import strict
from service.api.compat import items as views
from service.api.compat.conversations import errors
from service.api.compat.ids import parse_conversation, parse_response
from service.api.compat.schemas import ResponseCreate, response_object
from service.api.compat.stream import first_event, response_events
from service.api.correlation import correlation_id
from service.api.deps import Caller
from service.api.headers import CORRELATION_ID, RETRY_AFTER, IdempotencyKey
from service.api.sse import closed_with_response
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
from service.core.items import client_tools, input_count, turn_input
from service.core.model import ForkPoint
from service.core.model import IdempotencyKey as Key
from service.core.plans import TurnPlan
from service.usecases.relay import Relay
from service.usecases.turns import TurnService

UNSUPPORTED = {
    "instructions": "instructions are not supported: the system prompt is the server's "
    "(SYSTEM_PROMPT), the same for every turn of the history",
    "background": "background responses are not supported yet on /v1 (use /api/v1)",
}


def check_fields(asked: ResponseCreate, turns: TurnService) -> None:
    """400 naming a field this server cannot honour, for any call."""
    for field, why in UNSUPPORTED.items():
        if getattr(asked, field) not in (None, False):
            raise InvalidInput(why + ".", param=field)
    model = turns.provider.origin.model
    if asked.model is not None and asked.model != model:
        raise InvalidInput(f"model: this server answers with {model!r} only.", param="model")
    views.includes(asked.include)


async def plan_of(
    asked: ResponseCreate, body: bytes, turns: TurnService, owner: str, key: str | None
) -> TurnPlan:
    """The turn ``asked`` for, or 400 naming the field that cannot be honoured. A
    ``previous_response_id`` that is its conversation's latest response continues it (under
    If-Match: a turn committed meanwhile makes it 400); an earlier one forks the conversation
    there, and the turn runs on the fork (made by the turn's own commit)."""
    check_fields(asked, turns)
    if_match, raw_id, fork = None, asked.conversation_id, None
    if asked.previous_response_id is not None:
        if raw_id is not None:
            raise InvalidInput(
                "Send conversation or previous_response_id, not both.",
                param="previous_response_id",
            )
        cid, revision = parse_response(asked.previous_response_id)
        info = await turns.store.describe(cid, owner)
        if info is None or info.revision < revision:
            raise ResponseNotFound()
        raw_id, if_match = str(cid), frozenset({revision})
        fork = ForkPoint(cid, revision) if revision < info.revision else None
    assert raw_id is not None  # without either, the call is stateless (see ``stateless``)
    message, items = turn_input(asked.input)
    tools = client_tools(asked.tools, set(turns.tool_names))
    plan = turns.plan(message, str(parse_conversation(raw_id)), if_match, owner=owner,
                      truncate=asked.truncation != "disabled", items=items)  # fmt: skip
    plan = dataclasses.replace(plan, client_tools=tools)
    if fork is not None:
        plan = plan.forked(fork)
    if key is None:
        return plan
    # The whole request is the key's subject: a retry must ask exactly the same.
    return plan.with_idempotency(Key(owner, key, hashlib.sha256(body).hexdigest()))


async def stateless(
    asked: ResponseCreate, relay: Relay, turns: TurnService, owner: str
) -> dict[str, Any]:
    """A call without a conversation: relayed to the provider (store false), nothing kept."""
    check_fields(asked, turns)
    if asked.stream:
        raise InvalidInput("stream: not for calls without a conversation yet.", param="stream")
    given = (
        asked.input if isinstance(asked.input, list) else [{"role": "user", "content": asked.input}]
    )
    started = time.time()
    reply = await relay.respond(await relay.resolve(owner, given), client_tools(asked.tools, set()))
    if reply.incomplete_reason == "content_filter":
        raise ContentFiltered()
    # Sealed reasoning is kept in the answer: a client that keeps the history has no other
    # copy to send back (OpenAI keeps it server-side; a store: false provider cannot).
    output = views.output_items(uuid.uuid4(), 1, reply.output_items, 0, encrypted=True)
    return response_object(
        None, None, rid=f"resp_{uuid.uuid4().hex}", model=turns.provider.origin.model,
        status=reply.status,
        output=output, incomplete_reason=reply.incomplete_reason, created_at=started,
        store=False,
    )  # fmt: skip


def not_latest(asked: ResponseCreate, exc: PreconditionFailed) -> Exception:
    if asked.previous_response_id is None:
        return exc
    return InvalidInput(
        "previous_response_id must name the latest response of its conversation.",
        param="previous_response_id",
    )


class OpenAIResponses(Controller):
    path = "/v1/responses"
    tags = ["openai"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @post(
        "/", status_code=200, summary="A turn: a Response, or (stream) its event stream.",
        description="A busy conversation is 400 conversation_locked, as OpenAI answers it.",
        before_request=strict(ResponseCreate), response_headers=[CORRELATION_ID, RETRY_AFTER],
        responses=errors(
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
        asked = data
        if asked.conversation is None and asked.previous_response_id is None:
            return Response(await stateless(asked, api.relay, api.turns, api.owner))
        plan = await plan_of(asked, await request.body(), api.turns, api.owner, idempotency_key)
        try:
            if asked.stream:
                return await self._stream(request, asked, plan, api.turns, api.sse_keepalive_s)
            started = time.time()
            done = await api.turns.run(plan)
        except PreconditionFailed as exc:
            raise not_latest(asked, exc) from None
        assert done.revision is not None
        output = views.output_items(done.conversation_id, done.revision, done.items, done.inputs)
        return Response(response_object(
            done.conversation_id, done.revision, model=api.turns.provider.origin.model,
            status=done.status, output=output, incomplete_reason=done.incomplete_reason,
            created_at=started, truncation=asked.truncation,
        ))  # fmt: skip

    async def _stream(
        self,
        request: Request[Any, Any, Any],
        asked: ResponseCreate,
        plan: TurnPlan,
        turns: TurnService,
        keepalive_s: float,
    ) -> ServerSentEvent:
        events = turns.events(plan, stream=True, announce=True)
        first = await first_event(events)
        messages = response_events(
            first, events, model=turns.provider.origin.model, truncation=asked.truncation,
            keepalive_s=keepalive_s, correlation_id=correlation_id(request.scope),
        )  # fmt: skip
        closed_with_response(request.scope, messages)
        return ServerSentEvent(messages)

    @get(
        "/{response_id:str}", summary="A committed response.",
        response_headers=[CORRELATION_ID], responses=errors(ResponseNotFound),
    )  # fmt: skip
    async def retrieve(self, response_id: FromPath[str], api: Caller) -> dict[str, Any]:
        cid, revision = parse_response(response_id)
        conversation = await api.store.load(cid, api.owner, after_revision=revision - 1)
        if conversation is None or not conversation.turns:
            raise ResponseNotFound()
        turn = conversation.turns[0]
        first = input_count(turn.replay_items)
        output = views.output_items(cid, revision, turn.replay_items[first:], first)
        return response_object(
            cid, revision, model=turn.origin.model if turn.origin else "unknown",
            status=turn.status, output=output, incomplete_reason=turn.incomplete_reason,
            created_at=turn.created_at,
        )  # fmt: skip
