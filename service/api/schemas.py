"""The HTTP schema as msgspec structs (they also drive the OpenAPI document)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

import msgspec

from service.core.ids import Ids
from service.core.model import (
    ConversationInfo,
    ReplyStatus,
    Role,
    RunStatus,
    RunView,
    Summary,
    TranscriptPage,
)
from service.core.plans import MESSAGE_PATTERN
from service.core.usage import Usage
from service.usecases.turns import TurnDone

# What the turn service enforces on a message (service/plans.py), stated for the OpenAPI
# document only: the service's own checks give clearer messages than a regex failure would.
MESSAGE_SCHEMA = {
    "minLength": 1,
    "maxLength": 100_000,  # MAX_MESSAGE_CHARS' default
    "pattern": MESSAGE_PATTERN,
}


class ChatRequest(msgspec.Struct, forbid_unknown_fields=True):
    message: Annotated[
        str,
        msgspec.Meta(
            extra_json_schema={
                "description": "The user's message (at most MAX_MESSAGE_CHARS characters).",
                "extra": MESSAGE_SCHEMA,
            }
        ),
    ]
    conversation_id: Annotated[
        str | None,
        msgspec.Meta(
            description="UUID of the conversation to continue; omit or null to start one."
        ),
    ] = None
    background: Annotated[
        bool,
        msgspec.Meta(
            description="Run on when the client goes away: /chat answers 202 with the turn id "
            "at once; a /chat/stream client may drop and resume (GET /api/v1/turns/{id}/events)."
        ),
    ] = False
    model: Annotated[
        str | None,
        msgspec.Meta(
            extra_json_schema={
                "description": "The model that answers this turn, which picks its provider "
                "(GET /v1/models lists them); omit or null for the configured default model.",
                "extra": {"pattern": r"^[^\x00]*$"},  # PlanRules.check_model: no NUL
            }
        ),
    ] = None


class InputTokens(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokens(msgspec.Struct):
    reasoning_tokens: int


class UsageView(msgspec.Struct):
    """What the turn's provider calls cost, in the provider's tokens (the Responses API's
    ``usage``, added up over the turn's calls)."""

    input_tokens: int
    input_tokens_details: InputTokens
    output_tokens: int
    output_tokens_details: OutputTokens
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage | None) -> UsageView | None:
        if usage is None:
            return None
        return cls(
            usage.input_tokens,
            InputTokens(usage.cached_tokens, usage.cache_write_tokens),
            usage.output_tokens,
            OutputTokens(usage.reasoning_tokens),
            usage.total_tokens,
        )


class ChatResponse(msgspec.Struct):
    conversation_id: str
    message: str
    status: ReplyStatus
    incomplete_reason: Literal["max_output_tokens"] | None
    revision: int
    correlation_id: str
    usage: UsageView | None

    @classmethod
    def of(cls, done: TurnDone, correlation_id: str) -> ChatResponse:
        assert done.revision is not None  # a plain turn answers only what it committed
        return cls(
            conversation_id=str(done.conversation_id),
            message=done.message,
            status=done.status,
            incomplete_reason=done.incomplete_reason,  # type: ignore[arg-type]
            revision=done.revision,
            correlation_id=correlation_id,
            usage=UsageView.of(done.usage),
        )


class TurnAccepted(msgspec.Struct):
    """A background turn, started (or the one an Idempotency-Key retry names)."""

    turn_id: str
    conversation_id: str
    status: RunStatus


class TurnError(msgspec.Struct):
    code: str
    message: str


class TurnView(msgspec.Struct):
    turn_id: str
    conversation_id: str
    status: RunStatus
    revision: Annotated[int | None, msgspec.Meta(description="The revision it committed.")]
    message: Annotated[str | None, msgspec.Meta(description="The reply it committed.")]
    error: TurnError | None

    @classmethod
    def of(cls, view: RunView) -> TurnView:
        error = TurnError(view.error_code, view.error_message or "") if view.error_code else None
        return cls(
            turn_id=str(view.id),
            conversation_id=str(view.conversation_id),
            status=view.status,
            revision=view.revision,
            message=view.message,
            error=error,
        )


class TranscriptMessage(msgspec.Struct):
    role: Role
    content: str
    in_context: Annotated[
        bool,
        msgspec.Meta(
            description="False once the message's turn left the model's context window: it is "
            "kept for display and audit, but no longer sent to the model."
        ),
    ]


class ToolCallView(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(description="The tool the model asked for.")]
    arguments: Annotated[str, msgspec.Meta(description="The arguments as the model proposed.")]
    accepted: Annotated[bool, msgspec.Meta(description="Whether the gate accepted them.")]
    status: Annotated[
        str,
        msgspec.Meta(
            description="OK, INVALID, UNKNOWN_TOOL, BUSY, BUDGET, NOT_FOUND, TIMEOUT or TOOL_ERROR."
        ),
    ]
    duration_ms: float


class TurnRecord(msgspec.Struct):
    turn: Annotated[int, msgspec.Meta(description="The turn's number (the revision it made).")]
    context_from: Annotated[
        int, msgspec.Meta(description="The first earlier turn the model saw for this turn.")
    ]
    prompt_version: str | None
    tool_calls: list[ToolCallView]
    usage: UsageView | None
    model: Annotated[str | None, msgspec.Meta(description="The model that made its reply.")]
    response_id: Annotated[
        str,
        msgspec.Meta(
            description="The /v1 Response this turn is (GET /v1/responses/{id}: its output; "
            ".../input_items: its input)."
        ),
    ] = ""


class ConversationView(msgspec.Struct):
    conversation_id: str
    revision: int
    created_at: datetime
    updated_at: datetime
    messages: Annotated[
        list[TranscriptMessage], msgspec.Meta(description="The messages of this page's turns.")
    ]
    context_start: Annotated[
        int, msgspec.Meta(description="The first turn the next request will still carry.")
    ]
    turns: list[TurnRecord]
    more_before: Annotated[
        bool, msgspec.Meta(description="Earlier turns exist: ask with before=<first turn>.")
    ]
    more_after: Annotated[
        bool, msgspec.Meta(description="Later turns exist: ask with after=<last turn>.")
    ]

    @classmethod
    def of(cls, page: TranscriptPage, ids: Ids) -> ConversationView:
        conversation = page.conversation
        messages: list[TranscriptMessage] = []
        for turn in page.turns:
            seen = turn.number >= conversation.context_start
            messages += [
                TranscriptMessage(role, text, seen)  # type: ignore[arg-type]
                for role, text in turn.messages()
            ]
        return cls(
            conversation_id=str(conversation.id),
            revision=conversation.revision,
            created_at=conversation.created_at,
            updated_at=conversation.updated_at,
            messages=messages,
            context_start=conversation.context_start,
            turns=[
                TurnRecord(
                    turn.number,
                    turn.context_from,
                    turn.prompt_version,
                    [
                        ToolCallView(c.name, c.arguments, c.accepted, str(c.status), c.duration_ms)
                        for c in turn.tool_calls
                    ],
                    UsageView.of(turn.usage),
                    turn.model,
                    ids.response(conversation.id, turn.number),
                )
                for turn in page.turns
            ],
            more_before=page.more_before,
            more_after=page.more_after,
        )


class ConversationSummary(msgspec.Struct):
    conversation_id: str
    revision: int
    created_at: datetime
    updated_at: datetime


class ForkRequest(msgspec.Struct, forbid_unknown_fields=True):
    at_revision: Annotated[
        int, msgspec.Meta(ge=1, le=2**31 - 1, description="The fork holds turns 1..at_revision.")
    ]


class CompactRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``{}``: the compaction's model and instructions are the server's."""


class Compaction(msgspec.Struct):
    """A compaction committed on its own: the revision it made, and what it cost."""

    conversation_id: str
    revision: int
    usage: UsageView | None


class ForkOrigin(msgspec.Struct):
    conversation_id: str
    revision: int


class Forked(msgspec.Struct):
    """A fork: a new conversation holding the first turns of another, which is untouched."""

    conversation_id: str
    revision: int
    created_at: datetime
    updated_at: datetime
    forked_from: ForkOrigin

    @classmethod
    def of(cls, info: ConversationInfo, source: UUID, at_revision: int) -> Forked:
        origin = ForkOrigin(str(source), at_revision)
        return cls(str(info.id), info.revision, info.created_at, info.updated_at, origin)


class ConversationList(msgspec.Struct):
    conversations: list[ConversationSummary]
    next: Annotated[str | None, msgspec.Meta(description="Cursor of the next page, if any.")]

    @classmethod
    def of(cls, page: list[Summary], cursor: str | None) -> ConversationList:
        items = [
            ConversationSummary(str(s.id), s.revision, s.created_at, s.updated_at) for s in page
        ]
        return cls(items, cursor)


class ErrorDetail(msgspec.Struct):
    code: str
    message: str
    correlation_id: str


class ErrorEnvelope(msgspec.Struct):
    error: ErrorDetail
