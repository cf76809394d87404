"""/v1/conversations: OpenAI's Conversations API over turnstore's conversations.

The same conversations as /api/v1 (``conv_<hex>`` is the uuid ``/api/v1`` shows), the same
owners, ETags and If-Match. Metadata is not part of the history: updating it is no commit.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Annotated, Any, Literal

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter

from service.api.compat import item_views as views
from service.api.compat.objects import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    conversation_object,
    deleted_object,
)
from service.api.compat.queries import AfterItem, Include, ItemLimit
from service.api.conversations import delete_conversation
from service.api.deps import Caller, Writer
from service.api.errors import WRITE_ERRORS
from service.api.headers import IdempotencyKey, with_etag
from service.api.routes import Resource, openai_route
from service.core.errors import (
    ConversationConflict,
    ConversationFull,
    ConversationNotFound,
    ItemNotFound,
    PreconditionFailed,
)
from service.core.ids import parse_conversation_id
from service.core.model import check_metadata

Order = Annotated[
    Literal["asc", "desc"], QueryParameter(description="Commit order or newest first.")
]


class OpenAIConversations(Resource):
    path = "/v1/conversations"

    @post(
        "/",
        **openai_route(
            "Create a conversation (metadata, up to 20 items).",
            ConversationFull,
            *WRITE_ERRORS,
            body=ConversationCreate,
            etag=True,
        ),
    )
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ConversationCreate],
        api: Caller,
        idempotency_key: IdempotencyKey = None,
    ) -> Response[dict[str, Any]]:
        metadata = check_metadata(data.metadata)
        key = api.key(idempotency_key, "v1.conversations.create", await request.body())
        info = await api.cases.conversations.create(api.owner, metadata, data.items, key)
        return with_etag(conversation_object(info), info.revision)

    @get(
        "/{conversation_id:str}",
        **openai_route(
            "A conversation: id, created_at, metadata.", ConversationNotFound, etag=True
        ),
    )
    async def retrieve(
        self, conversation_id: FromPath[str], api: Caller
    ) -> Response[dict[str, Any]]:
        info = await api.cases.conversations.describe(
            parse_conversation_id(conversation_id), api.owner
        )
        return with_etag(conversation_object(info), info.revision)

    @post(
        "/{conversation_id:str}",
        **openai_route(
            "Replace its metadata (no commit).",
            PreconditionFailed,
            *WRITE_ERRORS,
            body=ConversationUpdate,
            etag=True,
        ),
    )
    async def update(
        self,
        data: JSONBody[ConversationUpdate],
        conversation_id: FromPath[str],
        writer: Writer,
    ) -> Response[dict[str, Any]]:
        metadata = check_metadata(data.metadata)
        cid = parse_conversation_id(conversation_id)
        key = await writer.body_keyed("v1.conversations.update", str(cid))
        info = await writer.cases.conversations.update_metadata(
            cid, writer.owner, metadata, writer.precondition, key
        )
        return with_etag(conversation_object(info), info.revision)

    @delete(
        "/{conversation_id:str}",
        **openai_route("Delete it and all its turns.", PreconditionFailed, *WRITE_ERRORS),
    )
    async def remove(self, conversation_id: FromPath[str], writer: Writer) -> dict[str, Any]:
        return deleted_object(await delete_conversation(writer, conversation_id))

    @get(
        "/{conversation_id:str}/items",
        **openai_route("Its items, newest first by default.", ConversationNotFound),
    )
    async def items(
        self,
        conversation_id: FromPath[str],
        api: Caller,
        include: Include = None,
        after: AfterItem = None,
        limit: ItemLimit = 20,
        order: Order = "desc",
    ) -> dict[str, Any]:
        cid, encrypted, newest_first = (
            parse_conversation_id(conversation_id),
            views.includes(include),
            order == "desc",
        )
        turns = api.cases.conversations.walk(cid, api.owner, newest_first=newest_first)
        async with aclosing(turns):
            page = await views.page_of(
                api.ids,
                turns,
                cid,
                after=after,
                limit=limit,
                newest_first=newest_first,
                encrypted=encrypted,
            )
        return page.body()

    @post(
        "/{conversation_id:str}/items",
        **openai_route(
            "Append up to 20 items without calling the model: one commit.",
            ConversationConflict,
            PreconditionFailed,
            ConversationFull,
            *WRITE_ERRORS,
            body=ItemsCreate,
            etag=True,
        ),
    )
    async def append(
        self,
        data: JSONBody[ItemsCreate],
        conversation_id: FromPath[str],
        writer: Writer,
        include: Include = None,
    ) -> Response[dict[str, Any]]:
        cid, encrypted = parse_conversation_id(conversation_id), views.includes(include)
        key = await writer.body_keyed("v1.items.append", str(cid))
        turn, revision = await writer.cases.conversations.append_items(
            cid, writer.owner, data.items, writer.precondition, key
        )
        added = views.turn_items(writer.ids, cid, revision, turn, encrypted=encrypted)
        return with_etag(views.ItemPage(added, has_more=False).body(), revision)

    @delete(
        "/{conversation_id:str}/items/{item_id:str}",
        **openai_route(
            "Remove the latest item (a commit); any other item: 400.",
            ItemNotFound,
            ConversationConflict,
            PreconditionFailed,
            *WRITE_ERRORS,
            etag=True,
        ),
    )
    async def pop(
        self,
        conversation_id: FromPath[str],
        item_id: FromPath[str],
        writer: Writer,
    ) -> Response[dict[str, Any]]:
        cid = parse_conversation_id(conversation_id)
        key = writer.keyed("v1.items.delete", str(cid), item_id)
        info = await writer.cases.conversations.pop_item(
            cid, writer.owner, item_id, writer.precondition, key
        )
        return with_etag(conversation_object(info), info.revision)

    @get(
        "/{conversation_id:str}/items/{item_id:str}",
        **openai_route("One of its items.", ConversationNotFound, ItemNotFound),
    )
    async def item(
        self,
        conversation_id: FromPath[str],
        item_id: FromPath[str],
        api: Caller,
        include: Include = None,
    ) -> dict[str, Any]:
        cid, encrypted = parse_conversation_id(conversation_id), views.includes(include)
        await api.cases.conversations.describe(cid, api.owner)  # 404 for a conversation not found
        ref = api.ids.parse_item(item_id)  # names the one turn to read
        if ref is None or ref.conversation_id != cid:
            raise ItemNotFound()
        turn = await api.cases.conversations.turn_at(cid, api.owner, ref.revision)
        shown = (
            views.turn_items(api.ids, cid, ref.revision, turn, encrypted=encrypted) if turn else []
        )
        return views.one_of(shown, item_id)
