"""GET (one or a page) and DELETE /api/v1/conversations, scoped to the caller."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Response, delete, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, QueryParameter

from service.api.headers import CORRELATION_ID, ETAG, IfMatch, Owner, Store, etag, parse_if_match
from service.api.schemas import ConversationList, ConversationView, ErrorEnvelope
from service.errors import ConversationNotFound
from service.plans import parse_conversation_id

_NOT_FOUND = {404: ResponseSpec(ErrorEnvelope, description="conversation_not_found")}
_STORAGE = {500: ResponseSpec(ErrorEnvelope, description="storage_error")}
_AUTH = {401: ResponseSpec(ErrorEnvelope, description="unauthorized")}

Limit = Annotated[int, QueryParameter(ge=1, le=100, description="Page size (1-100).")]
After = Annotated[
    str | None,
    QueryParameter(description="The `next` cursor of the previous page; omit for the first."),
]


class ConversationController(Controller):
    path = "/api/v1/conversations"
    tags = ["conversations"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @get(
        "/",
        summary="The caller's conversations, newest first, with cursor pagination.",
        response_headers=[CORRELATION_ID],
        responses={400: ResponseSpec(ErrorEnvelope, description="invalid_input"), **_AUTH},
    )
    async def page(
        self, store: Store, owner: Owner, limit: Limit = 20, after: After = None
    ) -> ConversationList:
        return ConversationList.of(*await store.list_conversations(owner, limit, after))

    @get(
        "/{conversation_id:str}",
        summary="The conversation's transcript and revision.",
        response_headers=[ETAG, CORRELATION_ID],
        responses={**_NOT_FOUND, **_STORAGE, **_AUTH},
    )
    async def read(
        self, conversation_id: FromPath[str], store: Store, owner: Owner
    ) -> Response[ConversationView]:
        conversation = await store.load(parse_conversation_id(conversation_id))
        if conversation is None or conversation.owner != owner:
            raise ConversationNotFound()
        return Response(
            ConversationView.of(conversation), headers={"ETag": etag(conversation.revision)}
        )

    @delete(
        "/{conversation_id:str}",
        summary="Delete the conversation: transcript and replay items.",
        response_headers=[CORRELATION_ID],
        responses={
            **_NOT_FOUND,
            412: ResponseSpec(ErrorEnvelope, description="precondition_failed"),
            **_STORAGE,
            **_AUTH,
        },
    )
    async def remove(
        self, conversation_id: FromPath[str], store: Store, owner: Owner, if_match: IfMatch = None
    ) -> None:
        cid = parse_conversation_id(conversation_id)
        await store.delete(cid, owner, parse_if_match(if_match))
