"""HTTP request metrics and traces: requests by route template (never the raw path: ids would
explode the series), method and status, and their duration (for a stream, until its last
byte); a server span per request, continuing the client's W3C ``traceparent``."""

from __future__ import annotations

import time

from litestar.enums import ScopeType
from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import propagate, trace

from service.core.errors import TurnstoreError
from service.platform import tracing
from service.platform.metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS

UNMATCHED = "unmatched"


def status_of_exception(exc: Exception) -> int:
    if isinstance(exc, TurnstoreError):
        return exc.status
    return exc.status_code if isinstance(exc, HTTPException) else 500


def count_unmatched(scope: Scope, status: int) -> None:
    """A request no route matched (404, 405) never reaches the middlewares: the exception
    handler counts it here, under ``unmatched`` (a matched one was counted on its way)."""
    if "route_handler" not in scope:
        HTTP_REQUESTS.labels(UNMATCHED, scope.get("method", ""), str(status)).inc()


def http_metrics_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        route = str(scope.get("path_template") or UNMATCHED)
        method = scope.get("method", "")
        try:
            if not tracing.active():
                await app(scope, receive, observed)
                return
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            with tracing.span(
                f"{method} {route}", context=propagate.extract(carrier),
                kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": method, "http.route": route},
            ) as span:  # fmt: skip
                try:
                    await app(scope, receive, observed)
                finally:
                    span.set_attribute("http.response.status_code", status)
        except Exception as exc:
            # Refused before a response started (415, an oversized head): the exception
            # handler answers it outside this middleware, with the status the error names.
            status = status_of_exception(exc)
            raise
        finally:
            HTTP_REQUESTS.labels(route, method, str(status)).inc()
            HTTP_REQUEST_SECONDS.labels(route, method).observe(time.perf_counter() - started)

    return middleware
