"""A hard limit on the request head (target plus headers), whatever the ASGI server.

uvicorn's h11 ``max_incomplete_event_size`` bounds what it buffers of a head still arriving,
but a head that arrives in one read (up to 256 KiB on loopback) is parsed whatever its size.
This check makes the limit exact, and answers in the contract's envelope.
"""

from __future__ import annotations

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from service.errors import InvalidInput

MAX_HEAD_BYTES = 16 * 1024  # room for a large JWT


def head_bytes(scope: Scope) -> int:
    target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
    return target + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def head_limit_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP and head_bytes(scope) > MAX_HEAD_BYTES:
            raise InvalidInput(f"The request's headers exceed {MAX_HEAD_BYTES} bytes.")
        await app(scope, receive, send)

    return middleware
