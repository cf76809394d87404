"""Part 3, holding power: 1,000 concurrent streaming turns on one replica whose provider takes
2 s per reply. Counts completions, samples the server's RSS and its database connections."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import psutil

from bench.database import libpq_url, sqlalchemy_url
from bench.http import Connection
from bench.server import free_port, running
from service.platform.db import APPLICATION_NAME
from service.platform.settings import Settings

STREAM = "/api/v1/chat/stream"
SAMPLE_S = 0.02


@dataclass
class HoldingResult:
    streams: int
    completed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    connections_open_max: int = 0
    connections_busy_max: int = 0
    pool_size: int = Settings().db_pool_size

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_peak_mb - self.rss_before_mb


async def _stream(port: int, conversation: str | None) -> str:
    """One streaming turn; its outcome: 'done' when it committed, else what went wrong."""
    body = json.dumps({"message": "hold on", "conversation_id": conversation}).encode()
    try:
        status, text = await Connection(port).request("POST", STREAM, body, close=True)
    except OSError as exc:
        return f"connection: {type(exc).__name__}"
    if status != 200:
        return f"http {status}"
    events = [line[7:] for line in text.decode().splitlines() if line.startswith("event: ")]
    if events[-1:] == ["message.done"] and events.count("message.done") == 1:
        done = json.loads(text.decode().rsplit("data: ", 1)[1])
        return "done" if done["revision"] is not None else "done, not committed"
    return f"stream ended with {events[-1:]}"


async def _sample(pid: int, url: str, result: HoldingResult, stop: asyncio.Event) -> None:
    process = psutil.Process(pid)
    conn = await asyncpg.connect(libpq_url(url))
    query = (
        "SELECT count(*), count(*) FILTER (WHERE state <> 'idle') FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = $1"
    )
    try:
        while not stop.is_set():
            result.rss_peak_mb = max(result.rss_peak_mb, process.memory_info().rss / 2**20)
            opened, busy = await conn.fetchrow(query, APPLICATION_NAME)
            result.connections_open_max = max(result.connections_open_max, opened)
            result.connections_busy_max = max(result.connections_busy_max, busy)
            await asyncio.sleep(SAMPLE_S)
    finally:
        await conn.close()


async def _hold(pid: int, port: int, url: str, conversations: list[str]) -> HoldingResult:
    result = HoldingResult(len(conversations))
    await _stream(port, None)  # warm-up: one turn end to end
    result.rss_before_mb = result.rss_peak_mb = psutil.Process(pid).memory_info().rss / 2**20
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(pid, url, result, stop))
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(_stream(port, cid) for cid in conversations))
    result.seconds = time.perf_counter() - start
    stop.set()
    await sampler
    result.outcomes = Counter(outcomes)
    result.completed = result.outcomes["done"]
    return result


def run(url: str, log_dir: Path, conversations: list[str]) -> HoldingResult:
    port = free_port()
    command = [
        *(sys.executable, "-m", "uvicorn", "--factory", "bench.slow_app:create"),
        *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
        *("--backlog", "4096", "--timeout-graceful-shutdown", "10"),
    ]
    env = {"DATABASE_URL": sqlalchemy_url(url)}
    with running(command, port, env, log_dir / "holding-server.log") as pid:
        return asyncio.run(_hold(pid, port, url, conversations))
