"""`turnstore serve` for part 16 (bench/latency.py), keeping when each request arrived.

``python -m bench.arrivals --port P`` serves ``service.app:app`` with the options `turnstore
serve` gives uvicorn (service/api/http_server.py), the database and provider from the
environment as `turnstore serve` takes them, wrapped in one ASGI function: it notes
``time.monotonic()`` (one clock for every process of the machine) as each HTTP request
reaches the application, before anything of turnstore's runs, and answers ``GET
/bench/arrivals`` itself (the times as JSON, in order). What it adds to a request is that one
clock read and a list append, outside of what is measured.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import uvicorn

from service.api.http_server import uvicorn_options
from service.platform.logs import configure as configure_logging
from service.platform.settings import Settings

PATH = "/bench/arrivals"


class Arrivals:
    def __init__(self, app: Any) -> None:
        self.app, self.times = app, []  # type: list[float]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrived = time.monotonic()
        if scope["path"] != PATH:
            self.times.append(arrived)
            return await self.app(scope, receive, send)
        body = json.dumps(self.times).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.arrivals")
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    settings = Settings.from_env()
    import service.app

    uvicorn.run(
        Arrivals(service.app.app),
        host="127.0.0.1",
        port=port,
        **uvicorn_options(settings),
        log_config=configure_logging(settings.log_format, settings.log_level.upper()),
    )


if __name__ == "__main__":
    main()
