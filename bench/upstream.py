"""A fake provider of the tests (an object with ``async handle(httpx.Request) ->
httpx.Response``, such as tests/support/fakeapi.py's) served over real HTTP on a thread of its
own, so that a `turnstore serve` process of the bench calls it as it would call the provider.

Its answer's body goes out chunk by chunk as the fake yields it (a streamed answer keeps the
fake's own pace), and ``arrivals`` holds when each request arrived (``time.monotonic()``,
one clock for every process of the machine), before its body is read.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import httpx
import uvicorn

from bench.server import free_port


class Fake(Protocol):
    async def handle(self, request: httpx.Request) -> httpx.Response: ...


class Served:
    def __init__(self, api: Fake) -> None:
        self.api, self.port = api, free_port()
        self.handled_s = 0.0  # the fake's own time, its streamed bodies included
        self.arrivals: list[float] = []
        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=self.port, log_level="error", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.arrivals.append(time.monotonic())
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        request = httpx.Request(
            scope["method"], self.url + scope["path"], headers=headers, content=body
        )
        started = time.perf_counter()
        answer = await self.api.handle(request)
        raw_headers = [
            (k.encode(), v.encode())
            for k, v in answer.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding")
        ]
        await send(
            {"type": "http.response.start", "status": answer.status_code, "headers": raw_headers}
        )
        async for chunk in answer.stream:  # type: ignore[union-attr]  # an async fake's
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        self.handled_s += time.perf_counter() - started

    def __enter__(self) -> Served:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
