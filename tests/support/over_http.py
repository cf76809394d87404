"""A fake provider of the tests (an object whose ``handle(httpx.Request)`` answers an
``httpx.Response``, at once or awaited: fakeapi.py's, fake_anthropic.py's, fake_gemini.py's,
fake_chat.py's) as an ASGI application, so that it is served over real HTTP (helpers.serve,
bench/upstream.py) and a client's connections are real ones.

The answer's body goes out chunk by chunk as the fake yields it (a streamed answer keeps the
fake's own pace). ``arrivals`` holds when each request arrived (``time.monotonic()``, one clock
for every process of the machine), before its body is read; ``connections`` each client
connection a request came on (its address and port), in order of first use. With ``held``
set, a body's end waits for it: a server that keeps a finished stream open.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import httpx


class OverHttp:
    def __init__(self, fake: Any) -> None:
        self.fake = fake
        self.arrivals: list[float] = []
        self.connections: list[tuple[str, int]] = []
        self.handled_s = 0.0  # the fake's own time, its streamed bodies included
        self.held: asyncio.Event | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.arrivals.append(time.monotonic())
        client = tuple(scope["client"])
        if client not in self.connections:
            self.connections.append(client)  # type: ignore[arg-type]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        host = dict(scope["headers"]).get(b"host", b"fake").decode()
        query = scope.get("query_string", b"").decode()
        url = f"http://{host}{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        request = httpx.Request(scope["method"], url, headers=headers, content=body)
        started = time.perf_counter()
        answer = self.fake.handle(request)
        if inspect.isawaitable(answer):
            answer = await answer
        raw_headers = [
            (k.encode(), v.encode())
            for k, v in answer.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding")
        ]
        await send(
            {"type": "http.response.start", "status": answer.status_code, "headers": raw_headers}
        )
        async for chunk in answer.stream:  # as the fake made it, read or not
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if self.held is not None:
            await self.held.wait()
        await send({"type": "http.response.body", "body": b""})
        self.handled_s += time.perf_counter() - started
