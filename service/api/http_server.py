"""How `turnstore serve` runs uvicorn: bounds on what a client can hold before the app sees it.

uvicorn's httptools protocol (faster than h11, and used since httptools is installed) gets:

- a bound on the request head: at most MAX_HEAD_BYTES of a head still arriving, counted over
  the reads since the request began (h11 has this rule by itself; httptools has none). A head
  that arrives whole in one read still reaches the app, whose middleware
  (service/api/limits.py) then answers 400 in the envelope;
- a bound on the time to send it: a connection whose request head has not fully arrived
  HTTP_HEADER_TIMEOUT_S after the connection opened, or after the request began, is answered
  408 and closed (slow-header clients, "slowloris"); an idle kept-alive connection is closed
  after HTTP_KEEPALIVE_S (uvicorn's own timer);
- its own 400 for requests it cannot parse, in the contract's envelope instead of plain text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.limits import MAX_HEAD_BYTES
from service.platform.settings import Settings


@functools.cache
def _head_timeout_s() -> float:
    # From the environment, like the app itself: `--workers` processes re-import this module.
    return Settings.from_env().http_header_timeout_s


def error_response(status: int, reason: bytes, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response in the contract's envelope, closing the connection."""
    cid = uuid.uuid4().hex
    body = json.dumps({"error": {"code": code, "message": message, "correlation_id": cid}})
    head = (
        f"HTTP/1.1 {status} {reason.decode()}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-correlation-id: {cid}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body.encode()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above."""

    head_timeout_s: float | None = None  # None: HTTP_HEADER_TIMEOUT_S
    _head_open = False
    _head_bytes = 0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_bytes = True, 0
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_open:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_open = False
                self.send_400_response("Request header fields too large.")

    def send_400_response(self, msg: str) -> None:
        self._disarm_head_timer()
        self.transport.write(error_response(400, b"Bad Request", "invalid_input", msg))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            timeout = self.head_timeout_s or _head_timeout_s()
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        message = "The request head did not arrive in time."
        self.transport.write(error_response(408, b"Request Timeout", "invalid_input", message))
        self.transport.close()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What `turnstore serve` (and the tests' servers) give uvicorn."""
    return {
        "http": BoundedHttpToolsProtocol,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
        "timeout_keep_alive": settings.http_keepalive_s,
    }
