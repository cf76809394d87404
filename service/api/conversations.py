"""GET (one or a page) and DELETE /api/v1/conversations, scoped to the caller."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter

from service.api.deps import Caller, WriteApi, Writer
from service.api.errors import WRITE_ERRORS
from service.api.finding import FILTERS, Filters
from service.api.headers import (
    IdempotencyKey,
    with_etag,
)
from service.api.routes import Resource, route
from service.api.schemas import (
    Compaction,
    CompactRequest,
    ConversationList,
    ConversationView,
    Forked,
    ForkRequest,
    UsageView,
)
from service.core.errors import (
    ConversationBusy,
    ConversationConflict,
    ConversationFull,
    ConversationNotFound,
    InvalidInput,
    PreconditionFailed,
    StorageError,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
)
from service.core.ids import parse_conversation_id
from service.core.model import PageRequest
from service.core.plans import compaction_plan

MAX_PAGE_TURNS = 200
MAX_PAGE_BYTES = 1024 * 1024  # of message text: what one read may hold in memory

Limit = Annotated[int, QueryParameter(ge=1, le=100, description="Page size (1-100).")]
TurnLimit = Annotated[
    int,
    QueryParameter(
        ge=1,
        le=MAX_PAGE_TURNS,
        description=f"Turns per page (1-{MAX_PAGE_TURNS}); a page also stops near "
        f"{MAX_PAGE_BYTES // 1024} KiB of text (one turn at least).",
    ),
]
AfterTurn = Annotated[
    int,
    QueryParameter(gt=-1, le=2**31 - 2, description="Turns after this one (0: from the first)."),
]
BeforeTurn = Annotated[
    int | None,
    QueryParameter(
        ge=1,
        le=2**31 - 1,
        description="Turns before this one; alone, the latest turns before it.",
    ),
]

After = Annotated[
    str | None,
    QueryParameter(description="The `next` cursor of the previous page; omit for the first."),
]


class ConversationController(Resource):
    path = "/api/v1/conversations"

    @get(
        "/",
        **route(
            "The caller's conversations, newest first, with cursor pagination and filters.",
            InvalidInput,
            Unauthorized,
            StorageError,
            description="Filters (all must hold): `metadata[KEY]=VALUE` (repeatable), `model` "
            "(a turn used it), `created_after` / `created_before` / `updated_after` / "
            "`updated_before` (RFC 3339), `q` (words of the transcript, all of them, whole "
            "words, case-folded). Each is served by an index. An unknown parameter is 400.",
        ),
        dependencies={"filters": FILTERS},
    )
    async def page(
        self, api: Caller, filters: Filters, limit: Limit = 20, after: After = None
    ) -> ConversationList:
        found = await api.cases.conversations.listing(api.owner, limit, after, filters)
        return ConversationList.of(*found)

    @get(
        "/{conversation_id:str}",
        **route(
            "The conversation's transcript (a page of turns) and revision.",
            InvalidInput,
            Unauthorized,
            ConversationNotFound,
            StorageError,
            etag=True,
        ),
    )
    async def read(
        self,
        conversation_id: FromPath[str],
        api: Caller,
        limit: TurnLimit = 50,
        after: AfterTurn = 0,
        before: BeforeTurn = None,
    ) -> Response[ConversationView]:
        page = PageRequest(after, before, limit, MAX_PAGE_BYTES)
        cid = parse_conversation_id(conversation_id)
        found = await api.cases.conversations.transcript(cid, api.owner, page)
        view = ConversationView.of(found, api.ids)
        return with_etag(view, view.revision)

    @post(
        "/{conversation_id:str}/fork",
        **route(
            "Fork: a new conversation holding turns 1..at_revision of this one.",
            InvalidInput,
            Unauthorized,
            ConversationFull,
            *WRITE_ERRORS,
            body=ForkRequest,
            etag=True,
            status_code=201,
            description="The turns are copied as they are (replay items byte for byte, with their "
            "provider, window start and prompt version), in one statement; the source is "
            "untouched, and each conversation goes on (and is deleted or expires) on its own.",
        ),
    )
    async def fork(
        self,
        request: Request[Any, Any, Any],
        conversation_id: FromPath[str],
        data: JSONBody[ForkRequest],
        api: Caller,
        idempotency_key: IdempotencyKey = None,
    ) -> Response[Forked]:
        source = parse_conversation_id(conversation_id)
        key = api.key(idempotency_key, "fork", str(source), await request.body())
        info = await api.cases.conversations.fork(source, api.owner, data.at_revision, key)
        return with_etag(Forked.of(info, source, data.at_revision), info.revision)

    @post(
        "/{conversation_id:str}/compact",
        **route(
            "Compact the conversation now: one commit (revision + 1), If-Match honoured.",
            InvalidInput,
            Unauthorized,
            PreconditionFailed,
            ConversationConflict,
            ConversationBusy,
            ConversationFull,
            UpstreamError,
            UpstreamTimeout,
            *WRITE_ERRORS,
            body=CompactRequest,
            etag=True,
            status_code=200,
            description="The provider turns the context a turn would send into its kept user "
            "messages and one opaque compaction item; later turns start from it. The transcript "
            "keeps every turn.",
        ),
    )
    async def compact(
        self,
        conversation_id: FromPath[str],
        data: JSONBody[CompactRequest],
        writer: Writer,
    ) -> Response[Compaction]:
        cid = parse_conversation_id(conversation_id)
        key = await writer.body_keyed("compact", str(cid))
        plan = compaction_plan(cid, writer.owner, writer.precondition, key)
        revision, usage = await writer.cases.turns.compact(plan)
        body = Compaction(str(cid), revision, UsageView.of(usage))
        return with_etag(body, revision)

    @delete(
        "/{conversation_id:str}",
        **route(
            "Delete the conversation: transcript and replay items.",
            Unauthorized,
            PreconditionFailed,
            *WRITE_ERRORS,
        ),
    )
    async def remove(self, conversation_id: FromPath[str], writer: Writer) -> None:
        await delete_conversation(writer, conversation_id)


async def delete_conversation(writer: WriteApi, conversation_id: str) -> uuid.UUID:
    """Deleting a conversation, on either surface: one write under one route name, so a retry
    may switch surfaces."""
    cid = parse_conversation_id(conversation_id)
    key = writer.keyed("conversation.delete", str(cid))
    await writer.cases.conversations.delete(cid, writer.owner, writer.precondition, key)
    return cid
