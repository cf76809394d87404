"""The one place where exceptions become HTTP responses, all in the contract's envelope."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import Scope

from service.api.compat.objects import OpenAIError
from service.api.correlation import correlation_id
from service.api.schemas import ErrorEnvelope
from service.core.errors import (
    ContentFiltered,
    ContextLengthExceeded,
    ConversationConflict,
    ConversationFull,
    ConversationNotFound,
    IdempotencyKeyReused,
    InvalidInput,
    NotMigrated,
    NotReady,
    PreconditionFailed,
    RateLimited,
    RequestInProgress,
    StorageError,
    TooManyRequests,
    TurnstoreError,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
    envelope,
)

log = logging.getLogger("turnstore.api")

_CODE_BY_STATUS = {
    400: "invalid_input",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def documented(
    *errors: type[TurnstoreError], shape: type[Any] = ErrorEnvelope
) -> dict[int, ResponseSpec]:
    """The OpenAPI responses of an operation that may raise ``errors``: one entry per status,
    naming the codes (derived from the error classes, so the document cannot drift)."""
    codes: dict[int, list[str]] = {}
    if StorageError in errors:  # a replica whose database is not migrated yet answers 503
        errors = (*errors, NotMigrated)
    for error in errors:
        codes.setdefault(error.status, []).append(error.code)
    return {
        status: ResponseSpec(shape, description=" or ".join(names))
        for status, names in sorted(codes.items())
    }


# What any turn may answer, on either surface (for the OpenAPI document).
TURN_ERRORS: tuple[type[TurnstoreError], ...] = (
    ContextLengthExceeded,
    ConversationNotFound,
    ConversationConflict,
    RequestInProgress,
    PreconditionFailed,
    ContentFiltered,
    IdempotencyKeyReused,
    ConversationFull,
    RateLimited,
    TooManyRequests,
    UpstreamError,
    UpstreamTimeout,
)


# What any call that writes may answer besides its own errors (service/usecases/write_gate.py): its
# Idempotency-Key malformed, in use or reused, the owner's write budget, an owner shredded
# meanwhile, the database.
WRITE_ERRORS: tuple[type[TurnstoreError], ...] = (
    InvalidInput,
    RequestInProgress,
    IdempotencyKeyReused,
    TooManyRequests,
    ConversationNotFound,
    StorageError,
)


def openai_documented(*more: type[TurnstoreError]) -> dict[int, ResponseSpec]:
    """As ``documented``, for an operation of the OpenAI surface (its error shape)."""
    return documented(InvalidInput, Unauthorized, StorageError, *more, shape=OpenAIError)


def _framework_message(exc: HTTPException, request: Request[Any, Any, Any]) -> str:
    """The framework's refusals, in words a client can act on. A 404 or 405 names what is
    not served (the path, or the method and the methods the path takes)."""
    target = _printable(f"{request.method} {request.url.path}")
    if isinstance(exc, NotFoundException):
        return f"{target} is not served here (no such route)."
    if isinstance(exc, MethodNotAllowedException):
        headers = {name.lower(): value for name, value in (exc.headers or {}).items()}
        allowed = headers.get("allow", "")
        return f"{target} is not served here: this path takes {allowed or 'other methods'}."
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list):
        details = "; ".join(
            f"{item['key']}: {item.get('message')}" if item.get("key") else str(item.get("message"))
            for item in exc.extra
            if isinstance(item, dict)
        )
        return f"The request is invalid: {details}" if details else "The request is invalid."
    return str(exc.detail)


def _invalid_param(exc: HTTPException) -> str | None:
    """The parameter a framework refusal names (the first, when several are wrong)."""
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list):
        for item in exc.extra:
            if isinstance(item, dict) and isinstance(item.get("key"), str):
                return str(item["key"])
    return None


def _printable(text: str) -> str:
    """A request's own words, safe to repeat: bounded, without control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:200])


def log_failure(exc: TurnstoreError, cid: str) -> None:
    """One line for a 5xx: the cause's class and SQLSTATE only (a driver error's text can
    quote user data), and the Citus worker that failed when the error names one."""
    cause = type(exc.__cause__).__name__ if exc.__cause__ else "-"
    state = getattr(exc, "sqlstate", None)
    # not_ready's message is the service's own words (which schema, which database): keep it.
    why = f" ({exc.message})" if isinstance(exc, NotReady) else ""
    worker = getattr(exc, "worker", None)
    at = f" worker={worker}" if worker else ""
    log.warning(
        "%s%s: %s sqlstate=%s%s", exc.code, why, cause, state, at, extra={"correlation_id": cid}
    )


def error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    cid = correlation_id(request.scope)
    headers: dict[str, str] = {}
    param = None
    if isinstance(exc, TurnstoreError):
        status, code, message, param = exc.status, exc.code, exc.message, exc.param
        if isinstance(exc, RateLimited) and exc.retry_after:
            headers["Retry-After"] = exc.retry_after
        if isinstance(exc, Unauthorized):
            headers["WWW-Authenticate"] = 'Bearer realm="turnstore"' + (
                ', error="invalid_token"' if exc.token_sent else ""
            )
        if status >= 500:
            log_failure(exc, cid)
    elif isinstance(exc, HTTPException) and exc.status_code < 500:
        status, param = exc.status_code, _invalid_param(exc)
        code = _CODE_BY_STATUS.get(status, "http_error")
        message = _framework_message(exc, request)
        headers.update(exc.headers or {})
    else:
        log.exception("unhandled error", exc_info=exc, extra={"correlation_id": cid})
        status, code, message = 500, "internal_error", "Internal error."
    if is_openai(request.scope):
        return openai_error(status, code, message, param, cid, headers)
    return Response(envelope(code, message, cid), status_code=status, headers=headers)


def is_openai(scope: Scope) -> bool:
    return str(scope.get("path", "")).startswith("/v1/")


def openai_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def openai_error(
    status: int, code: str, message: str, param: str | None, cid: str, headers: dict[str, str]
) -> Response[Any]:
    """OpenAI's error shape. A busy conversation is ``400 conversation_locked`` as OpenAI
    answers it; ``x-should-retry`` keeps the SDKs from re-running a turn that lost a race
    (they retry every 409 by default) and lets them retry a request still in progress."""
    if code == "conversation_busy":
        status, code, param = 400, "conversation_locked", param or "conversation"
    if code == "conversation_conflict":
        headers["x-should-retry"] = "false"
    elif code == "request_in_progress":
        headers["x-should-retry"] = "true"
    body = {
        "message": message,
        "type": openai_type(status),
        "param": param,
        "code": code,
        "correlation_id": cid,
    }
    return Response({"error": body}, status_code=status, headers=headers)
