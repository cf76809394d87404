"""The HTTP schema as msgspec structs (they also drive the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from service.model import Message


class ChatRequest(msgspec.Struct, forbid_unknown_fields=True):
    message: Annotated[str, msgspec.Meta(description="The user's message.")]
    conversation_id: Annotated[
        str | None,
        msgspec.Meta(
            description="UUID of the conversation to continue; omit or null to start one."
        ),
    ] = None


class ChatResponse(msgspec.Struct):
    conversation_id: str
    message: str
    status: Literal["completed", "incomplete"]
    incomplete_reason: Literal["max_output_tokens"] | None
    revision: int
    correlation_id: str


class ConversationView(msgspec.Struct):
    conversation_id: str
    revision: int
    created_at: datetime
    updated_at: datetime
    messages: list[Message]


class ErrorDetail(msgspec.Struct):
    code: str
    message: str
    correlation_id: str


class ErrorEnvelope(msgspec.Struct):
    error: ErrorDetail
