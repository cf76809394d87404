"""Domain errors and their one mapping to HTTP.

TurnstoreError
 +-- InvalidInput                 400 invalid_input
 |    +-- ModelNotFound                400 model_not_found (a model not in MODELS)
 |    +-- PreviousResponseNotFound     400 previous_response_not_found
 |    +-- CompactionUnsupported        400 invalid_input (a provider that does not compact)
 +-- InvalidHost                  400 invalid_host (AUTH_MODE=none: a Host that is not loopback)
 +-- ContextLengthExceeded        400 context_length_exceeded
 +-- Unauthorized                 401 unauthorized (+ WWW-Authenticate)
 +-- ConversationNotFound         404 conversation_not_found
 |    +-- OwnerShredded                (the owner was shredded: nothing more is kept)
 +-- TurnNotFound                 404 turn_not_found
 +-- ResponseNotFound             404 response_not_found (the OpenAI surface)
 +-- UnknownModel                 404 model_not_found (the OpenAI surface's model lookup)
 +-- ItemNotFound                 404 item_not_found (the OpenAI surface)
 +-- MethodNotAllowed             405 method_not_allowed (the router's, where a path names a
 |                                     route of its own: GET /v1/responses/compact)
 +-- ConversationConflict         409 conversation_conflict
 +-- RequestInProgress            409 request_in_progress
 +-- ConversationBusy             409 conversation_busy
 +-- PreconditionFailed           412 precondition_failed
 +-- PayloadTooLarge              413 payload_too_large
 +-- UnsupportedMediaType         415 unsupported_media_type
 +-- ContentFiltered              422 content_filtered
 +-- IdempotencyKeyReused         422 idempotency_key_reused
 +-- ConversationFull             422 conversation_full (MAX_CONVERSATION_BYTES)
 +-- RateLimited                  429 rate_limited (+ Retry-After)
 |    +-- TooManyRequests              429 too_many_requests (an owner limit)
 +-- StorageError                 500 storage_error
 |    +-- NotMigrated                  503 not_ready (the schema is behind: no such table)
 +-- RequestRefused               400 <the provider's code> (the OpenAI surface: a client's
 |                                     request the provider refused, with its param)
 +-- UpstreamError                502 upstream_error
 |    +-- InvalidEncryptedContent      (sealed reasoning the provider cannot open)
 |    +-- ProviderRefused              (HTTP 400 naming a code and a field)
 +-- NotReady                     503 not_ready
 +-- Cancelled                    (a turn's end only) cancelled
 +-- TurnInterrupted              (a turn's end only) turn_interrupted
 +-- UpstreamTimeout              504 upstream_timeout

Each error carries a message that is safe to show a client: never SQL, provider bodies,
stack traces or secrets. The cause stays on ``__cause__`` for the logs.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID


def envelope(code: str, message: str, correlation_id: str) -> dict[str, Any]:
    """The contract's error body, for JSON answers and SSE error events alike."""
    return {"error": {"code": code, "message": message, "correlation_id": correlation_id}}


class TurnstoreError(Exception):
    code = "internal_error"
    status = 500
    default_message = "Internal error."
    default_param: str | None = None  # the request field an error of the kind is always about

    def __init__(self, message: str | None = None, *, param: str | None = None) -> None:
        self.message = message or self.default_message
        # The request field at fault, for the OpenAI surface's errors.
        self.param = param if param is not None else self.default_param
        super().__init__(self.message)


class InvalidInput(TurnstoreError):
    code, status, default_message = "invalid_input", 400, "The request is invalid."


class ModelNotFound(InvalidInput):
    """A model a request may not use (not in MODELS), refused as OpenAI refuses one."""

    code, default_message = "model_not_found", "The model does not exist or is not served here."
    default_param = "model"


class CompactionUnsupported(InvalidInput):
    """Compaction asked of a provider that does not compact (Anthropic): a client's
    ``context_management`` is refused naming it; CONTEXT_STRATEGY=compact falls back to the
    whole-turn window instead."""

    default_message = (
        "Compaction needs a provider that compacts (OpenAI, Azure); this model's does not."
    )
    default_param = "context_management"


class UnknownModel(TurnstoreError):
    """A model asked for by name (GET /v1/models/{id}) that is not served here."""

    code, status, default_message = "model_not_found", 404, "The model is not served here."


class InvalidHost(TurnstoreError):
    code, status = "invalid_host", 400
    default_message = (
        "This server answers only requests to its own names (Host); set ALLOWED_HOSTS to add more."
    )


class ContextLengthExceeded(TurnstoreError):
    code, status = "context_length_exceeded", 400
    default_message = "The conversation is too long for the model's context."


class Unauthorized(TurnstoreError):
    code, status = "unauthorized", 401
    default_message = "Credentials are required: Authorization: Bearer <key or token>."

    def __init__(self, message: str | None = None, *, token_sent: bool = False) -> None:
        super().__init__(message)
        self.token_sent = token_sent  # a credential was sent but refused (RFC 6750 invalid_token)


class ConversationNotFound(TurnstoreError):
    code, status, default_message = "conversation_not_found", 404, "Conversation not found."


class OwnerShredded(ConversationNotFound):
    """The owner was shredded (``turnstore owners shred``): nothing more is kept for them, and
    what they had is gone, as a conversation that does not exist."""

    default_message = "The conversation's owner was shredded; nothing was kept."


class TurnNotFound(TurnstoreError):
    code, status = "turn_not_found", 404
    default_message = "Turn not found (unknown, another owner's, or its events have expired)."


class ResponseNotFound(TurnstoreError):
    code, status, default_message = "response_not_found", 404, "Response not found."


class PreviousResponseNotFound(InvalidInput):
    """``previous_response_id`` names no stored response of the caller's (unknown, another
    owner's, deleted, expired, or made with ``store: false``), as OpenAI answers it."""

    code = "previous_response_not_found"
    default_message = "Previous response not found."
    default_param = "previous_response_id"


class ItemNotFound(TurnstoreError):
    code, status, default_message = "item_not_found", 404, "Item not found."


class ConversationConflict(TurnstoreError):
    code, status = "conversation_conflict", 409
    default_message = (
        "Another turn was committed to this conversation first; nothing of this turn was kept. "
        "Retry."
    )


class RequestInProgress(TurnstoreError):
    code, status = "request_in_progress", 409
    default_message = "A request with this Idempotency-Key is still running; retry later."

    def __init__(self, message: str | None = None, *, turn_id: UUID | None = None) -> None:
        super().__init__(message)
        self.turn_id = turn_id  # a background turn's run: its retries are answered with it


class ConversationBusy(TurnstoreError):
    code, status = "conversation_busy", 409
    default_message = (
        "Another turn of this conversation is running; this one was not queued (or waited in "
        "vain). Nothing was kept and the model was not called."
    )


class IdempotencyKeyReused(TurnstoreError):
    code, status = "idempotency_key_reused", 422
    default_message = "This Idempotency-Key was used before with a different request."


class PreconditionFailed(TurnstoreError):
    code, status = "precondition_failed", 412
    default_message = "If-Match does not match the conversation's current revision."


class PayloadTooLarge(TurnstoreError):
    code, status, default_message = "payload_too_large", 413, "The request body is too large."


class MethodNotAllowed(TurnstoreError):
    """The router's refusal of a method a path does not take (documented where a path that
    looks like an id names a route of its own, such as ``GET /v1/responses/compact``)."""

    code, status = "method_not_allowed", 405
    default_message = "This path does not take this method."


class UnsupportedMediaType(TurnstoreError):
    code, status = "unsupported_media_type", 415
    default_message = "The request body must be JSON, sent as Content-Type: application/json."


class ContentFiltered(TurnstoreError):
    code, status = "content_filtered", 422
    default_message = "The provider's content filter blocked the input or the output."


class ConversationFull(TurnstoreError):
    """The conversation would pass MAX_CONVERSATION_BYTES: nothing was kept."""

    code, status = "conversation_full", 422
    default_message = (
        "The conversation is full (MAX_CONVERSATION_BYTES): compact it, fork it from an "
        "earlier turn, or start a new conversation."
    )


class RateLimited(TurnstoreError):
    code, status, default_message = "rate_limited", 429, "The provider rate-limited the call."

    def __init__(self, message: str | None = None, *, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyRequests(RateLimited):
    """An owner limit (the contract's Limits) was reached: nothing was kept."""

    code, default_message = "too_many_requests", "Too many requests of this owner at once."

    @classmethod
    def running_turns(cls) -> TooManyRequests:
        """OWNER_MAX_RUNNING_TURNS. When a turn ends is not known (when its provider answers):
        a second is the shortest wait worth a client's retry."""
        return cls(
            "This owner runs as many turns at once as it may (OWNER_MAX_RUNNING_TURNS); nothing"
            " was kept. Retry after a while.",
            retry_after="1",
        )


class StorageError(TurnstoreError):
    code, status, default_message = "storage_error", 500, "The database failed; nothing was kept."

    def __init__(
        self, message: str | None = None, *, sqlstate: str | None = None, worker: str | None = None
    ) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate  # for the log line, never for the client
        self.worker = worker  # the Citus worker that failed ("host:port"), for the log line too

    @property
    def hopeless(self) -> bool:
        """Whether running the same statement again can never succeed: the server refuses it
        as such (SQLSTATE class 0A feature not supported, e.g. by Citus; 42 syntax error or
        undefined object), as opposed to a connection lost or a server restarting."""
        return self.sqlstate is not None and self.sqlstate[:2] in {"0A", "42"}


class NotMigrated(StorageError):
    """The database lacks a table or function of this release (SQLSTATE 42P01, 42883): its
    schema is behind, as ``/readyz`` says of this replica; not ready rather than failed (the
    same request succeeds once ``turnstore db upgrade`` ran)."""

    code, status = "not_ready", 503
    default_message = "The database is not migrated to this release's schema yet; retry later."


class UpstreamError(TurnstoreError):
    code, status = "upstream_error", 502
    default_message = "The provider failed or answered something unusable."


class InvalidEncryptedContent(UpstreamError):
    """The provider could not decrypt a replayed reasoning item (it was sealed elsewhere)."""

    default_message = "The provider could not use the conversation's sealed reasoning."


class ProviderRefused(UpstreamError):
    """The provider refused the request (HTTP 400), naming its code and the field at fault:
    the server's own fault on /api/v1 (502), the client's on /v1 (``client_error``)."""

    default_message = "The provider refused the request."

    def __init__(self, provider_code: str | None, param: str | None) -> None:
        super().__init__(param=_safe(param, _PARAM))
        self.provider_code = _safe(provider_code, _CODE) or "invalid_request"

    def client_error(self) -> RequestRefused:
        return RequestRefused(self.provider_code, self.param)


class RequestRefused(TurnstoreError):
    """A client's request that the provider refused (``ProviderRefused``), passed on as the
    provider's 400 with its code and param; the message is turnstore's own."""

    status = 400

    def __init__(self, code: str, param: str | None) -> None:
        where = f" ({param})" if param else ""
        super().__init__(f"The provider refused the request: {code}{where}.", param=param)
        self.code = code


_CODE = re.compile(r"[a-z0-9_.]{1,64}")
_PARAM = re.compile(r"[A-Za-z0-9_.\[\]-]{1,128}")


def _safe(value: str | None, shape: re.Pattern[str]) -> str | None:
    """A provider's code or param, passed on only when it looks like one (never free text)."""
    return value if isinstance(value, str) and shape.fullmatch(value) else None


class NotReady(TurnstoreError):
    code, status, default_message = "not_ready", 503, "Not ready."


class Cancelled(TurnstoreError):
    code, status = "cancelled", 409
    default_message = "The turn was cancelled; nothing was kept."


class TurnInterrupted(TurnstoreError):
    code, status = "turn_interrupted", 503
    default_message = (
        "The replica running the turn stopped before the commit; nothing was kept. Retry."
    )


class UpstreamTimeout(TurnstoreError):
    code, status, default_message = "upstream_timeout", 504, "The provider did not answer in time."


def status_of(code: str) -> int:
    """The HTTP status of an error code (a run's error event names only its code)."""
    return _STATUS.get(code, 500)


def _family(cls: type[TurnstoreError]) -> list[type[TurnstoreError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _family(child))]


_STATUS = {cls.code: cls.status for cls in reversed(_family(TurnstoreError))}
