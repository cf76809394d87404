"""A fake provider of the tests served over real HTTP (tests/support/over_http.py) on a thread
of its own, so that a `turnstore serve` process of the bench calls it as it would call the
provider: ``arrivals`` and ``connections`` are the served application's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from bench.server import free_port
from tests.support.over_http import OverHttp


class Served:
    def __init__(self, api: Any) -> None:
        self.api, self.port = api, free_port()
        self.app = OverHttp(api)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="error", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def arrivals(self) -> list[float]:
        return self.app.arrivals

    @property
    def connections(self) -> list[tuple[str, int]]:
        return self.app.connections

    @property
    def handled_s(self) -> float:
        return self.app.handled_s

    def __enter__(self) -> Served:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
