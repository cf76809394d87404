"""HTTP request metrics: requests by route template (never the raw path: ids would explode the
series), method and status, and their duration (for a stream, until its last byte)."""

from __future__ import annotations

import time

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from service.metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS


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

        try:
            await app(scope, receive, observed)
        finally:
            route = str(scope.get("path_template") or "unmatched")
            method = scope.get("method", "")
            HTTP_REQUESTS.labels(route, method, str(status)).inc()
            HTTP_REQUEST_SECONDS.labels(route, method).observe(time.perf_counter() - started)

    return middleware
