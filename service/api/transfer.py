"""A conversation out and in as ndjson (service/core/export_lines.py): GET .../{id}/export streamed
a page of turns at a time, POST .../import read as a stream, a line at a time."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Stream

from service.api.deps import Caller
from service.api.errors import WRITE_ERRORS
from service.api.headers import IdempotencyKey, with_etag
from service.api.routes import Resource, route
from service.core.errors import (
    ConversationFull,
    ConversationNotFound,
    InvalidInput,
    PayloadTooLarge,
    StorageError,
    Unauthorized,
    UnsupportedMediaType,
)
from service.core.export_lines import Importing
from service.core.ids import parse_conversation_id
from service.core.model import ConversationInfo

NDJSON = "application/x-ndjson"


class ImportedView(msgspec.Struct):
    conversation_id: str
    revision: int
    created_at: str
    updated_at: str

    @classmethod
    def of(cls, info: ConversationInfo) -> ImportedView:
        return cls(
            str(info.id), info.revision, info.created_at.isoformat(), info.updated_at.isoformat()
        )


class TransferController(Resource):
    path = "/api/v1/conversations"

    @get(
        "/{conversation_id:str}/export",
        media_type=NDJSON,
        **route(
            "The conversation as ndjson: itself, then each committed turn with its replay items.",
            InvalidInput,
            Unauthorized,
            ConversationNotFound,
            StorageError,
            description="The first line holds the conversation (id, metadata, times, revision, "
            "window start, forked_from), then one line per committed turn in order (revision, "
            "created_at, messages, replay items byte for byte, origin, prompt version, usage, "
            "tool calls). Streamed: memory is bounded whatever the conversation's size.",
        ),
    )
    async def export(self, conversation_id: FromPath[str], api: Caller) -> Stream:
        cid = parse_conversation_id(conversation_id)
        lines = await api.cases.conversations.export(cid, api.owner)
        return Stream(lines, media_type=NDJSON)

    @post(
        "/import",
        request_max_body_size=None,  # read as a stream, bounded by MAX_CONVERSATION_BYTES here
        **route(
            "A new conversation of the caller's, made of an export (ndjson).",
            InvalidInput,
            Unauthorized,
            PayloadTooLarge,
            UnsupportedMediaType,
            ConversationFull,
            *WRITE_ERRORS,
            etag=True,
            status_code=201,
            description="The same turns, revision, window start and origins, replay items byte "
            "for byte: the next turn on the same provider replays them. Each line at most "
            "MAX_BODY_BYTES, what it stores at most MAX_CONVERSATION_BYTES (the body twice that, "
            "for its JSON); every line is checked "
            "before anything is written (400 naming the line), and the import is one commit.",
        ),
    )
    async def import_(
        self,
        request: Request[Any, Any, Any],
        api: Caller,
        idempotency_key: IdempotencyKey = None,
    ) -> Response[ImportedView]:
        if request.content_type[0] != NDJSON:
            raise UnsupportedMediaType(f"An import is {NDJSON}.")
        rules, importing, digest = api.cases.rules, Importing(), hashlib.sha256()
        async for number, line in lines(
            request.stream(), rules.max_line_bytes, rules.max_import_bytes
        ):
            digest.update(line)
            importing.add(number, line)
        imported = importing.done()
        key = api.key(idempotency_key, "conversation.import", digest.hexdigest())
        info = await api.cases.conversations.import_conversation(api.owner, imported, key)
        return with_etag(ImportedView.of(info), info.revision)


async def lines(
    chunks: AsyncIterator[bytes], max_line: int, max_total: int | None
) -> AsyncIterator[tuple[int, bytes]]:
    """The body's lines, numbered from 1 (a last line without its newline too; blank lines
    between them skipped, but counted): InvalidInput naming a line longer than ``max_line``,
    PayloadTooLarge past ``max_total``. What is held is a line."""
    pending, number, total = bytearray(), 0, 0
    async for chunk in chunks:
        total += len(chunk)
        if max_total is not None and total > max_total:
            raise PayloadTooLarge(
                f"An import is at most {max_total} bytes (twice MAX_CONVERSATION_BYTES, and "
                "a line): what it stores is counted against MAX_CONVERSATION_BYTES itself."
            )
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            line, start = bytes(pending[start:end]), end + 1
            number += 1
            _fits(number, len(line), max_line)
            if line.strip():
                yield number, line
        del pending[:start]
        _fits(number + 1, len(pending), max_line)
    if pending.strip():
        yield number + 1, bytes(pending)


def _fits(number: int, size: int, most: int) -> None:
    if size > most:
        raise InvalidInput(
            f"Line {number} is longer than {most} bytes (MAX_BODY_BYTES); nothing was imported.",
            param=f"line {number}",
        )
