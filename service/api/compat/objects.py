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

from service.core.asks import Echo
from service.core.errors import InvalidInput
from service.core.ids import conversation_id, unstored_response_id
from service.core.model import ConversationInfo
from service.core.strictjson import holds_nul
from service.core.usage import Usage

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


# The fields of a Responses request that turnstore interprets; every other one is the
# provider's, sent to it as it came (ResponseCreate keeps them in ``fields``).
INTERPRETED = frozenset(
    {
        "conversation",
        "previous_response_id",
        "input",
        "model",
        "instructions",
        "tools",
        "stream",
        "store",
        "background",
        "include",
        "context_management",
        "truncation",
    }
)


class CompactCreate(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/responses/compact``: what that endpoint takes."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None


class TokensCount(msgspec.Struct):
    """``POST /v1/responses/input_tokens``: the body of a create (any field turnstore does not
    interpret is the provider's, as for a create)."""

    input: str | list[dict[str, Any]] | None = None
    model: str | None = None
    conversation: str | ConversationRef | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @property
    def conversation_id(self) -> str | None:
        ref = self.conversation
        return ref.id if isinstance(ref, ConversationRef) else ref


# What only a create takes: never sent to the provider's counting endpoint.
NOT_COUNTED = frozenset({"stream", "store", "background", "include", "context_management"})


def compaction_object(items: Sequence[msgspec.Raw], usage: Usage | None) -> dict[str, Any]:
    """OpenAI's ``response.compaction``: the provider's output as it came (its user messages
    and its compaction item), and what the call cost."""
    return {
        "id": unstored_response_id(),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [msgspec.json.decode(item) for item in items],
        "usage": (usage or Usage()).as_openai(),
    }


class ResponseCreate(msgspec.Struct):
    """The fields turnstore interprets (any other field is allowed: it is the provider's)."""

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
    tools: list[dict[str, Any]] | None = None
    context_management: list[dict[str, Any]] | None = None

    @property
    def conversation_id(self) -> str | None:
        ref = self.conversation
        return ref.id if isinstance(ref, ConversationRef) else ref


def passed_through(body: bytes) -> dict[str, msgspec.Raw]:
    """The request's fields turnstore does not interpret, as they came (a Response keeps
    some of them: one with a NUL character is refused, as every stored string is)."""
    whole = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    fields = {name: value for name, value in whole.items() if name not in INTERPRETED}
    for name, value in fields.items():
        if holds_nul(name) or holds_nul(msgspec.json.decode(value)):
            raise InvalidInput(f"{name}: holds a NUL character.", param=name)
    return fields


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str
    correlation_id: str


class OpenAIError(msgspec.Struct):
    """OpenAI's error shape (x-request-id carries the correlation id as well)."""

    error: OpenAIErrorDetail


def conversation_object(info: ConversationInfo) -> dict[str, Any]:
    return {
        "id": conversation_id(info.id),
        "object": "conversation",
        "created_at": int(info.created_at.timestamp()),
        "metadata": info.metadata,
    }


def deleted_object(cid: uuid.UUID) -> dict[str, Any]:
    return {"id": conversation_id(cid), "object": "conversation.deleted", "deleted": True}


_RATE_LIMITED = frozenset({"rate_limited"})
_DONE = frozenset({"completed", "incomplete", "failed", "cancelled"})


def _completed(created: int, at: datetime | float | None) -> int:
    """When a finished response was done (its commit, when known; else now), in whole
    seconds, never before it was created."""
    if isinstance(at, datetime):
        at = at.timestamp()
    return max(created, int(at if at is not None else time.time()))


def response_error(code: str, message: str) -> dict[str, str]:
    """A failed Response's ``error``: OpenAI's codes are a closed set (the SDKs validate
    them), so turnstore's own code leads the message."""
    openai_code = "rate_limit_exceeded" if code in _RATE_LIMITED else "server_error"
    return {"code": openai_code, "message": f"{code}: {message}"}


def response_object(
    cid: uuid.UUID | None,
    echo: Echo,
    *,
    rid: str,
    status: str,
    output: Sequence[dict[str, Any]] = (),
    incomplete_reason: str | None = None,
    completed_at: datetime | float | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """A Response ``rid`` of conversation ``cid`` (None: a ``store: false`` call's), created
    at ``echo.created_at`` (shown in whole seconds, as OpenAI does), ``completed_at`` once done.
    A stored response's own conversation (``echo.stored``) is not shown: on OpenAI it has
    none."""
    created = int(echo.created_at if echo.created_at is not None else time.time())
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": _completed(created, completed_at) if status in _DONE else None,
        "output": list(output),
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "error": None,
        "conversation": {"id": conversation_id(cid)} if cid and not echo.stored else None,
        **echo.body(),
        "usage": usage.as_openai() if usage is not None else None,
    }
