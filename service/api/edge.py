"""The edge: what every HTTP request passes on its way in and every send on its way out, as
one pure ASGI layer around the whole app (unmatched routes included).

In order: the correlation id (service/api/correlation.py) is decided and made visible to the
request's log lines; the request rules (service/api/limits.py) are checked, a refusal answered
in the contract's envelope by the app's exception handler; the request is counted and timed
by route template (service/api/observe.py), in a server span when tracing is on; every send is
bounded by the client send timeout, and the response's head gets X-Correlation-Id (and
x-request-id on /v1, where the OpenAI SDKs look). One layer instead of three middlewares, a
``before_send`` hook and three send wrappers: each was a frame, a closure and a scope lookup
per request or per send (bench/README.md, section 8).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from litestar import Request
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import propagate, trace

from service.api.correlation import correlation_id
from service.api.errors import error_response
from service.api.limits import ClientStoppedReading, RequestRules, check
from service.api.observe import UNMATCHED, observe
from service.api.sse import close_streams
from service.core.errors import TurnstoreError
from service.platform import tracing
from service.platform.logs import correlation_id_var

log = logging.getLogger("turnstore.api")


class Edge:
    """The app behind the edge (``app``), under the request rules ``rules``."""

    def __init__(self, app: ASGIApp, rules: RequestRules) -> None:
        self._app = app
        self._rules = rules

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self._app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500
        cid = correlation_id(scope)
        correlation_id_var.set(cid)
        head: list[tuple[bytes, bytes]] = [(b"x-correlation-id", cid.encode())]
        if scope["path"].startswith("/v1/"):
            head.append((b"x-request-id", head[0][1]))
        sends = _Sends(send, self._rules.send_timeout_s)

        async def edge_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), *head]
            await sends.send(message)

        try:
            if tracing.active():
                await self._traced(scope, receive, edge_send)
            else:
                await self._served(scope, receive, edge_send)
        except ClientStoppedReading:
            # The response had started: nothing more can be said to this client. The server
            # closes the connection.
            log.warning("the client stopped reading; its response was ended")
        finally:
            sends.close()
            try:
                await close_streams(scope)
            finally:
                route = scope.get("path_template") or UNMATCHED
                observe(route, scope.get("method", ""), status, time.perf_counter() - started)

    async def _served(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            check(scope, self._rules)
        except TurnstoreError as exc:
            await _refuse(scope, receive, send, exc)
            return
        await self._app(scope, receive, send)

    async def _traced(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request in a server span continuing the client's W3C ``traceparent``."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope.get("method", "")
        with tracing.span(
            f"{method} {scope['path']}",
            context=propagate.extract(carrier),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method},
        ) as span:
            status = 500

            async def observed(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await self._served(scope, receive, observed)
            finally:
                route = str(scope.get("path_template") or UNMATCHED)
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status)


class _Sends:
    """A response's sends, each failing with ClientStoppedReading once it has waited
    ``timeout_s`` for the client to read. One timer per response looks at the send under way
    (and comes back when it would be overdue), where a timeout per send armed and cancelled a
    timer each time: 3% of a turn's server CPU (bench/README.md, section 8)."""

    __slots__ = ("_loop", "_overdue", "_send", "_sender", "_since", "_timeout_s", "_timer")

    def __init__(self, send: Send, timeout_s: float) -> None:
        self._send, self._timeout_s = send, timeout_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the send under way began
        self._sender: asyncio.Task[Any] | None = None  # the task that awaits it
        self._timer: asyncio.TimerHandle | None = None
        self._overdue = False

    async def send(self, message: Message) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._timeout_s, self._look)
        self._since, self._sender = self._loop.time(), asyncio.current_task()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self._overdue or self._sender is None:
                raise
            self._sender.uncancel()  # the cancel was this timer's, not the task's owner's
            self._overdue = False  # a later cancel of a later send is someone else's
            raise ClientStoppedReading() from None
        finally:
            self._since = None

    def _look(self) -> None:
        now, since = self._loop.time(), self._since
        if since is not None and now - since >= self._timeout_s and self._sender is not None:
            self._overdue, self._timer = True, None
            self._sender.cancel()
            return
        self._timer = self._loop.call_at(
            (now if since is None else since) + self._timeout_s, self._look
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _refuse(scope: Scope, receive: Receive, send: Send, exc: TurnstoreError) -> None:
    """A request the rules refuse, answered before any route sees it, by the app's exception
    handler (the contract's envelope)."""
    request: Request[Any, Any, Any] = Request(scope, receive)
    response = error_response(request, exc).to_asgi_response(app=None, request=request)
    await response(scope, receive, send)
