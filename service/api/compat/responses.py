"""/v1/responses, the routes: a turn asked the OpenAI way (its command: commands.py; the use
case: service/usecases/responses.py), answered as a Response or as its event stream
(answers.py), and the response's life after it (response_views.py): retrieve (or resume its
stream), cancel, delete, its input items.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import ServerSentEvent

from service.api.bodies import strict
from service.api.compat import item_views as views
from service.api.compat.answers import answered, stateless
from service.api.compat.commands import asked_of, planned, tokens_counted
from service.api.compat.objects import (
    CompactCreate,
    ResponseCreate,
    TokensCount,
    compaction_object,
)
from service.api.compat.queries import AfterItem, Include, ItemLimit
from service.api.compat.response_views import input_items, resumed, shown
from service.api.deps import Caller, Writer
from service.api.errors import TURN_ERRORS, WRITE_ERRORS, openai_documented
from service.api.headers import (
    CORRELATION_ID,
    RETRY_AFTER,
    IdempotencyKey,
)
from service.api.routes import Resource, openai_route
from service.core.asks import Asked
from service.core.errors import (
    ConversationNotFound,
    MethodNotAllowed,
    PreviousResponseNotFound,
    RateLimited,
    ResponseNotFound,
    UpstreamError,
    UpstreamTimeout,
)

Order = Annotated[Literal["asc", "desc"], QueryParameter(description="Input order or reversed.")]
Streamed = Annotated[bool, QueryParameter(description="Replay its events, then follow it.")]
StartingAfter = Annotated[
    int | None,
    QueryParameter(ge=-1, le=2**31 - 1, description="Only the events after this sequence number."),
]


class OpenAIResponses(Resource):
    path = "/v1/responses"

    @post(
        "/",
        status_code=200,
        summary="A response: a Response, or (stream) its event stream.",
        description="A busy conversation is 400 conversation_locked, as OpenAI answers it.",
        before_request=strict(ResponseCreate),
        response_headers=[CORRELATION_ID, RETRY_AFTER],
        responses=openai_documented(*TURN_ERRORS, PreviousResponseNotFound),
    )
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ResponseCreate],
        writer: Writer,
    ) -> Response[dict[str, Any]] | ServerSentEvent:
        body, started = await request.body(), time.time()  # the Response's created_at, always
        ask = asked_of(data, body, writer.cases.responses, started)
        if data.store is False:  # a relay: nothing is written, also after a stored response
            return await stateless(request, data, ask, writer)
        plan = await planned(data, ask, writer, body)
        return await answered(request, plan, data, ask, writer)

    @post(
        "/compact",
        **openai_route(
            "The provider's compaction of a history (input and/or previous_response_id).",
            PreviousResponseNotFound,
            ResponseNotFound,
            RateLimited,
            UpstreamError,
            UpstreamTimeout,
            body=CompactCreate,
            description="Relayed as OpenAI serves it: items turnstore showed are restored to their "
            "stored bytes first; nothing is kept.",
        ),
    )
    async def compact(self, data: JSONBody[CompactCreate], api: Caller) -> dict[str, Any]:
        responses = api.cases.responses
        responses.check_model(data.model)
        asked = Asked(data.model, data.instructions)
        compacted = await responses.compact(api.owner, asked, data.input, data.previous_response_id)
        return compaction_object(compacted.items, compacted.usage)

    @post(
        "/input_tokens",
        **openai_route(
            "How many input tokens a create with this body would send.",
            PreviousResponseNotFound,
            ConversationNotFound,
            RateLimited,
            UpstreamError,
            UpstreamTimeout,
            description="Counted by the provider's own endpoint, stored items restored and the "
            "window applied; nothing is kept.",
        ),
    )
    async def input_tokens(
        self, request: Request[Any, Any, Any], data: JSONBody[TokensCount], api: Caller
    ) -> dict[str, Any]:
        counted = await tokens_counted(data, await request.body(), api)
        return {"object": "response.input_tokens", "input_tokens": counted}

    @get(
        "/{response_id:str}",
        **openai_route(
            "A response as it is now, or (stream) its events.", ResponseNotFound, MethodNotAllowed
        ),
    )
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
        return shown(await api.cases.kept.find(api.owner, response_id), api, encrypted=encrypted)

    @post(
        "/{response_id:str}/cancel",
        **openai_route("Stop a response wherever it runs.", ResponseNotFound),
    )
    async def cancel(self, response_id: FromPath[str], api: Caller) -> dict[str, Any]:
        return shown(await api.cases.kept.cancel(api.owner, response_id), api)

    @delete(
        "/{response_id:str}",
        **openai_route(
            "Forget a response (its turn stays).", ResponseNotFound, MethodNotAllowed, *WRITE_ERRORS
        ),
    )
    async def remove(
        self, response_id: FromPath[str], api: Caller, idempotency_key: IdempotencyKey = None
    ) -> dict[str, Any]:
        key = api.key(idempotency_key, "v1.responses.delete", response_id)
        await api.cases.kept.delete(api.owner, response_id, key)
        return {"id": response_id, "object": "response", "deleted": True}

    @get(
        "/{response_id:str}/input_items",
        **openai_route("The items a response was asked with.", ResponseNotFound),
    )
    async def input_items(
        self,
        response_id: FromPath[str],
        api: Caller,
        include: Include = None,
        after: AfterItem = None,
        limit: ItemLimit = 20,
        order: Order = "desc",
    ) -> dict[str, Any]:
        found = await api.cases.kept.find(api.owner, response_id)
        shown_items = input_items(found, api, views.includes(include))
        return views.page(shown_items, after=after, limit=limit, order=order).body()
