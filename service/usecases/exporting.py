"""Conversations out as ndjson (service/core/export_lines.py): one conversation, read a page of
turns at a time (what an export holds is a page, whatever the conversation's size), and every
conversation of an owner one after another (`turnstore owners export`, an owner's right of
access)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from service.core.export_lines import conversation_line, turn_line
from service.core.model import ConversationInfo
from service.store.ports import Reads
from service.usecases.paging import walk


async def exported(reads: Reads, info: ConversationInfo, owner: str) -> AsyncIterator[bytes]:
    """The lines of ``owner``'s conversation ``info``: itself, then its turns in order."""
    yield conversation_line(info)
    async for revision, turn in walk(reads, info.id, owner, 1, info.revision, newest_first=False):
        yield turn_line(revision, turn)


async def owner_export(reads: Reads, owner: str) -> AsyncIterator[bytes]:
    """Every conversation of ``owner``'s, newest first, one after another; one gone meanwhile
    is left out."""
    after: str | None = None
    while True:
        page, after = await reads.list_conversations(owner, 100, after)
        for summary in page:
            info = await reads.describe(summary.id, owner)
            if info is not None:
                async for line in exported(reads, info, owner):
                    yield line
        if after is None:
            return
