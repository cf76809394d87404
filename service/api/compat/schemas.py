"""The request bodies of the OpenAI surface, decoded strictly, and the objects it answers.

Bodies are decoded in C by msgspec into these structs (unknown fields refused), then checked
for duplicate keys. A refusal names the field at fault (``param``), as OpenAI's errors do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

import msgspec

from service.core.errors import InvalidInput
from service.core.ids import conversation_id, response_id
from service.core.model import ConversationInfo

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_CREATE_ITEMS = 20


class ConversationRef(msgspec.Struct, forbid_unknown_fields=True):
    id: str


class ConversationCreate(msgspec.Struct, forbid_unknown_fields=True):
    metadata: dict[str, str] | None = None
    items: list[dict[str, Any]] | None = None


class ItemsCreate(msgspec.Struct, forbid_unknown_fields=True):
    items: list[dict[str, Any]]


class ConversationUpdate(msgspec.Struct, forbid_unknown_fields=True):
    metadata: dict[str, str] | None


class ResponseCreate(msgspec.Struct, forbid_unknown_fields=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    conversation: str | ConversationRef | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    instructions: str | None = None
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def conversation_id(self) -> str | None:
        ref = self.conversation
        return ref.id if isinstance(ref, ConversationRef) else ref


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str
    correlation_id: str


class OpenAIError(msgspec.Struct):
    """OpenAI's error shape (x-request-id carries the correlation id as well)."""

    error: OpenAIErrorDetail


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidInput(f"metadata: at most {MAX_METADATA_PAIRS} pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidInput(
                f"metadata: keys at most {MAX_METADATA_KEY} characters, values at most "
                f"{MAX_METADATA_VALUE}.",
                param="metadata",
            )
    return metadata


def conversation_object(info: ConversationInfo) -> dict[str, Any]:
    return {
        "id": conversation_id(info.id),
        "object": "conversation",
        "created_at": int(info.created_at.timestamp()),
        "metadata": info.metadata,
    }


def deleted_object(cid: uuid.UUID) -> dict[str, Any]:
    return {"id": conversation_id(cid), "object": "conversation.deleted", "deleted": True}


def response_object(
    cid: uuid.UUID | None,
    revision: int | None,
    *,
    rid: str | None = None,
    model: str,
    status: str,
    output: Sequence[dict[str, Any]] = (),
    incomplete_reason: str | None = None,
    created_at: datetime | float | None = None,
    truncation: str | None = None,
    store: bool = True,
) -> dict[str, Any]:
    """A Response: a committed turn (``revision``), or (``rid`` given, no ``cid``) a
    stateless call's."""
    if isinstance(created_at, datetime):
        created_at = created_at.timestamp()
    assert rid is not None or cid is not None
    return {
        "id": rid or response_id(cid, revision or 0),  # type: ignore[arg-type]
        "object": "response",
        "created_at": created_at if created_at is not None else time.time(),
        "status": status,
        "model": model,
        "output": list(output),
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "error": None,
        "conversation": {"id": conversation_id(cid)} if cid else None,
        "previous_response_id": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "truncation": truncation or "auto",
        "store": store,
        "background": False,
        "text": {"format": {"type": "text"}},
        "usage": None,
    }
