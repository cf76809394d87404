"""X-Correlation-Id: reuse a safe client value or make one, on every response."""

from __future__ import annotations

import re
import uuid

from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from service.platform.logs import correlation_id_var

HEADER = "X-Correlation-Id"
_SAFE = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}")
_STATE_KEY = "correlation_id"


def correlation_id(scope: Scope) -> str:
    """The request's correlation id, decided once per request and kept in its scope."""
    state = scope.setdefault("state", {})
    cid = state.get(_STATE_KEY)
    if cid is None:
        sent = next((v for k, v in scope.get("headers", ()) if k == b"x-correlation-id"), b"")
        text = sent.decode("latin-1")
        cid = text if _SAFE.fullmatch(text) else uuid.uuid4().hex
        state[_STATE_KEY] = cid
    return str(cid)


async def add_correlation_header(message: Message, scope: Scope) -> None:
    """A ``before_send`` hook: it sees every response, the framework's own errors included."""
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        headers[HEADER] = correlation_id(scope)
        if str(scope.get("path", "")).startswith("/v1/"):
            headers["x-request-id"] = correlation_id(scope)  # where the OpenAI SDKs look


def correlation_middleware(app: ASGIApp) -> ASGIApp:
    """Make the request's correlation id visible to every log line of its handling."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            correlation_id_var.set(correlation_id(scope))
        await app(scope, receive, send)

    return middleware
