"""Part 2, end to end: chat turns over HTTP through a real `turnstore serve` process with the
zero-latency fake provider, the same 64 conversations x 20 turns at concurrency 32."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.database import sqlalchemy_url
from bench.dbwork import DbMeter, DbWork
from bench.http import Connection
from bench.server import free_port, process_cpu_s, running, turnstore_command
from bench.workload import payload

CHAT = "/api/v1/chat"


@dataclass
class E2EResult:
    turns_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms: float  # the server process's CPU time per turn: steadier than turns/s
    seeded: list[str]  # conversations made for the holding-power run
    db: DbWork | None = None  # the database's work per turn
    workers: int = 1


def _body(message: str, conversation: str | None) -> bytes:
    return json.dumps({"message": message, "conversation_id": conversation}).encode()


async def _turn(conn: Connection, message: str, conversation: str | None) -> str:
    status, body = await conn.request("POST", CHAT, _body(message, conversation))
    if status != 200:
        raise RuntimeError(f"turn failed: {status} {body[:200]!r}")
    cid: str = json.loads(body)["conversation_id"]
    return cid


async def _load(port: int, conversations: int, turns: int, concurrency: int) -> list[float]:
    numbers = list(range(conversations))
    latencies: list[float] = []

    async def worker() -> None:
        conn = Connection(port)
        try:
            while numbers:
                n, cid = numbers.pop(), None
                for history in range(turns):
                    start = time.perf_counter()
                    cid = await _turn(conn, payload(n, history).user_text, cid)
                    latencies.append(time.perf_counter() - start)
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def _seed(port: int, count: int, concurrency: int) -> list[str]:
    """``count`` conversations with one turn each."""
    left, made = list(range(count)), []

    async def worker() -> None:
        conn = Connection(port)
        try:
            while left:
                made.append(await _turn(conn, f"seed {left.pop()}", None))
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return made


async def _measure(pid: int, port: int, seed: int, url: str, workers: int) -> E2EResult:
    await _load(port, 4, 3, 4)  # warm-up
    cpu, start = process_cpu_s(pid), time.perf_counter()
    async with DbMeter(url) as meter:
        latencies = await _load(port, 64, 20, 32)
    elapsed, cpu = time.perf_counter() - start, process_cpu_s(pid) - cpu
    cuts = statistics.quantiles(latencies, n=100)
    seeded = await _seed(port, seed, 32)
    turns = len(latencies)
    return E2EResult(
        turns / elapsed, cuts[49] * 1000, cuts[98] * 1000, cpu / turns * 1000, seeded,
        meter.per_turn(turns), workers,
    )  # fmt: skip


def run(
    url: str,
    log_dir: Path,
    seed: int,
    extra_env: dict[str, str] | None = None,
    name: str = "e2e",
    workers: int = 1,
) -> E2EResult:
    port = free_port()
    command = [*turnstore_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(workers)]
    env = {"DATABASE_URL": sqlalchemy_url(url), "LLM_PROVIDER": "fake", **(extra_env or {})}
    with running(command, port, env, log_dir / f"{name}-server.log") as pid:
        return asyncio.run(_measure(pid, port, seed, url, workers))
