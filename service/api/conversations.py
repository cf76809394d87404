"""GET (one or a page) and DELETE /api/v1/conversations, scoped to the caller."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Response, delete, get
from litestar.params import FromPath, QueryParameter

from service.api.deps import Owner, Store
from service.api.errors import documented
from service.api.headers import CORRELATION_ID, ETAG, IfMatch, etag, parse_if_match
from service.api.schemas import ConversationList, ConversationView
from service.errors import (
    ConversationNotFound,
    InvalidInput,
    PreconditionFailed,
    StorageError,
    Unauthorized,
)
from service.plans import parse_conversation_id

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
        responses=documented(InvalidInput, Unauthorized, StorageError),
    )
    async def page(
        self, store: Store, owner: Owner, limit: Limit = 20, after: After = None
    ) -> ConversationList:
        return ConversationList.of(*await store.list_conversations(owner, limit, after))

    @get(
        "/{conversation_id:str}",
        summary="The conversation's transcript and revision.",
        response_headers=[ETAG, CORRELATION_ID],
        responses=documented(Unauthorized, ConversationNotFound, StorageError),
    )
    async def read(
        self, conversation_id: FromPath[str], store: Store, owner: Owner
    ) -> Response[ConversationView]:
        conversation = await store.load(parse_conversation_id(conversation_id), owner)
        if conversation is None:
            raise ConversationNotFound()
        return Response(
            ConversationView.of(conversation), headers={"ETag": etag(conversation.revision)}
        )

    @delete(
        "/{conversation_id:str}",
        summary="Delete the conversation: transcript and replay items.",
        response_headers=[CORRELATION_ID],
        responses=documented(Unauthorized, ConversationNotFound, PreconditionFailed, StorageError),
    )
    async def remove(
        self, conversation_id: FromPath[str], store: Store, owner: Owner, if_match: IfMatch = None
    ) -> None:
        cid = parse_conversation_id(conversation_id)
        await store.delete(cid, owner, parse_if_match(if_match))
