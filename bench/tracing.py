"""Part 7, the cost of tracing: part 2's end-to-end run with tracing off, then on, exporting
every span over OTLP/HTTP to a sink in this process (it answers 200 and counts what it got)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import e2e


@dataclass
class Sink:
    requests: int = 0
    bytes: int = 0


@contextmanager
def sink() -> Iterator[tuple[str, Sink]]:
    counts = Sink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = int(self.headers.get("content-length", 0))
            self.rfile.read(size)
            counts.requests, counts.bytes = counts.requests + 1, counts.bytes + size
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()


def run(url: str, log_dir: Path) -> list[str]:
    off = e2e.run(url, log_dir, 0, name="tracing-off")
    with sink() as (endpoint, counts):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        on = e2e.run(url, log_dir, 0, env, name="tracing-on")
    return [
        f"tracing off: {off.turns_per_s:.0f} turns/s, p50 {off.p50_ms:.1f} ms, "
        f"server CPU {off.server_cpu_ms:.2f} ms per turn",
        f"tracing on:  {on.turns_per_s:.0f} turns/s, p50 {on.p50_ms:.1f} ms, "
        f"server CPU {on.server_cpu_ms:.2f} ms per turn "
        f"({counts.requests} OTLP exports, {counts.bytes / 1024:.0f} KiB)",
    ]
