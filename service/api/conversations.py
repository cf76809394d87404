"""GET and DELETE /api/v1/conversations/{conversation_id}."""

from __future__ import annotations

from litestar import Controller, Response, delete, get
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath

from service.api.headers import CORRELATION_ID, ETAG, IfMatch, Store, etag, parse_if_match
from service.api.schemas import ConversationView, ErrorEnvelope
from service.errors import ConversationNotFound
from service.turns import parse_conversation_id

_NOT_FOUND = {404: ResponseSpec(ErrorEnvelope, description="conversation_not_found")}


class ConversationController(Controller):
    path = "/api/v1/conversations"
    tags = ["conversations"]  # noqa: RUF012 (Litestar reads it as a class attribute)

    @get(
        "/{conversation_id:str}",
        summary="The conversation's transcript and revision.",
        response_headers=[ETAG, CORRELATION_ID],
        responses={**_NOT_FOUND, 500: ResponseSpec(ErrorEnvelope, description="storage_error")},
    )
    async def read(
        self, conversation_id: FromPath[str], store: Store
    ) -> Response[ConversationView]:
        conversation = await store.load(parse_conversation_id(conversation_id))
        if conversation is None:
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
            500: ResponseSpec(ErrorEnvelope, description="storage_error"),
        },
    )
    async def remove(
        self, conversation_id: FromPath[str], store: Store, if_match: IfMatch = None
    ) -> None:
        await store.delete(parse_conversation_id(conversation_id), parse_if_match(if_match))
