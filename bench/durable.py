"""Part 5, durable turns: two replicas (``uvicorn --factory bench.drip_app:create``) on one
database; the provider types ``DELTAS`` deltas ``DRIP_S`` apart, each its send time. A client
streams a background turn from replica A while a reader follows the same turn from replica B
(``GET /api/v1/turns/{id}/events``): how late each delta reaches either, against the time
the provider sent it; and what the durable turn costs the database (write transactions from
``pg_current_xact_id()``, WAL bytes from ``pg_current_wal_lsn()``, event rows), beside a
streamed turn nobody follows elsewhere and a plain ``/chat`` turn."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.database import libpq_url, sqlalchemy_url
from bench.http import Connection, sse
from bench.server import free_port, running

DELTAS = 300
DRIP_S = 0.01
CHAT = "/api/v1/chat"


@dataclass
class Cost:
    turns: int
    transactions: float
    wal_bytes: float
    event_rows: float


@dataclass
class Latency:
    concurrency: int
    turns: int
    a_ms: list[float] = field(default_factory=list)  # at the client streaming from A
    b_ms: list[float] = field(default_factory=list)  # at the reader on B (live deltas only)
    mismatches: int = 0  # turns where B did not see exactly what A saw


@dataclass
class DurableResult:
    latencies: list[Latency]
    costs: dict[str, Cost]


async def _counters(url: str) -> tuple[int, int, int]:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        row = await conn.fetchrow(
            "SELECT pg_current_xact_id()::text::bigint, pg_current_wal_lsn() - '0/0',"
            " (SELECT count(*) FROM turn_events)"
        )
        return int(row[0]), int(row[1]), int(row[2])
    finally:
        await conn.close()


async def _cost(url: str, turns: int, work: Callable[[], Awaitable[None]]) -> Cost:
    before = await _counters(url)
    await work()
    after = await _counters(url)
    # One transaction is the second probe's own.
    xacts, wal, rows = (after[0] - before[0] - 1), after[1] - before[1], after[2] - before[2]
    return Cost(turns, xacts / turns, wal / turns, rows / turns)


async def _seed(port: int, count: int) -> list[str]:
    conn = Connection(port)
    try:
        cids = []
        for _ in range(count):
            status, body = await conn.request("POST", CHAT, b'{"message": "hello"}')
            assert status == 200, body
            cids.append(json.loads(body)["conversation_id"])
        return cids
    finally:
        await conn.close()


async def _follow(port: int, turn_id: str, latency: Latency | None) -> str:
    text, opened = [], 0.0
    async for head, event in sse(port, "GET", f"/api/v1/turns/{turn_id}/events?after=0"):
        if head:
            assert head["status"] == "200", head
            opened = time.time()
        elif event.get("event") == "message.delta":
            delta = json.loads(event["data"])["delta"]
            text.append(delta)
            sent = float(delta)
            if latency is not None and sent >= opened:  # not a replayed one
                latency.b_ms.append((time.time() - sent) * 1000)
    return "".join(text)


async def _turn(a: int, b: int | None, cid: str, latency: Latency | None) -> None:
    body = json.dumps({"message": "type", "conversation_id": cid, "background": True}).encode()
    text: list[str] = []
    reader: asyncio.Task[str] | None = None
    async for head, event in sse(a, "POST", f"{CHAT}/stream", body):
        if head:
            assert head["status"] == "200", head
            if b is not None:
                reader = asyncio.create_task(_follow(b, head["x-turn-id"], latency))
        elif event.get("event") == "message.delta":
            delta = json.loads(event["data"])["delta"]
            text.append(delta)
            if latency is not None:
                latency.a_ms.append((time.time() - float(delta)) * 1000)
        elif event.get("event") == "error":
            raise RuntimeError(event["data"])
    seen = "".join(text)
    if reader is not None and (not seen or await reader != seen) and latency is not None:
        latency.mismatches += 1


async def _measure(a: int, b: int, url: str) -> DurableResult:
    cids = await _seed(a, 20)
    latencies = []
    for concurrency in (1, 20):
        latency = Latency(concurrency, concurrency * (3 if concurrency == 1 else 1))
        for _ in range(latency.turns // concurrency):
            await asyncio.gather(*(_turn(a, b, cid, latency) for cid in cids[:concurrency]))
        latencies.append(latency)

    async def followed() -> None:
        await asyncio.gather(*(_turn(a, b, cid, None) for cid in cids[:10]))

    async def alone() -> None:
        await asyncio.gather(*(_turn(a, None, cid, None) for cid in cids[:10]))

    async def plain() -> None:
        conns = [Connection(a) for _ in range(10)]
        body = [json.dumps({"message": "x", "conversation_id": c}).encode() for c in cids[:10]]
        await asyncio.gather(
            *(c.request("POST", CHAT, m) for c, m in zip(conns, body, strict=True))
        )
        await asyncio.gather(*(c.close() for c in conns))

    costs = {
        "streamed, followed from B": await _cost(url, 10, followed),
        "streamed, nobody else follows": await _cost(url, 10, alone),
        "/chat, not streamed": await _cost(url, 10, plain),
    }
    return DurableResult(latencies, costs)


def run(url: str, log_dir: Path) -> DurableResult:
    ports = [free_port(), free_port()]
    env = {
        "DATABASE_URL": sqlalchemy_url(url),
        "DRIP_DELTAS": str(DELTAS),
        "DRIP_S": str(DRIP_S),
    }

    def command(port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "uvicorn", "--factory", "bench.drip_app:create"),
            *("--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"),
        ]

    with (
        running(command(ports[0]), ports[0], env, log_dir / "durable-a.log"),
        running(command(ports[1]), ports[1], env, log_dir / "durable-b.log"),
    ):
        return asyncio.run(_measure(*ports, url))


def _cuts(values: list[float]) -> str:
    if len(values) < 2:
        return "no samples"
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {cuts[49]:.1f} ms, p99 {cuts[98]:.1f} ms, max {max(values):.1f} ms"


def lines(result: DurableResult) -> list[str]:
    out = []
    for lat in result.latencies:
        out.append(
            f"{lat.turns} turns of {DELTAS} deltas, {lat.concurrency} at once "
            f"({lat.concurrency * 1 / DRIP_S:.0f} deltas/s); B saw other text than A: "
            f"{lat.mismatches} turns"
        )
        out.append(f"  delta latency at A's client ({len(lat.a_ms)}): {_cuts(lat.a_ms)}")
        out.append(f"  delta latency at B's reader ({len(lat.b_ms)}): {_cuts(lat.b_ms)}")
    out.append(f"database work per turn ({DELTAS} deltas):")
    for label, cost in result.costs.items():
        out.append(
            f"  {label:32} {cost.transactions:5.1f} write transactions, "
            f"{cost.wal_bytes / 1024:6.1f} KiB WAL, {cost.event_rows:5.1f} event rows; per "
            f"delta {cost.transactions / DELTAS:.3f} transactions, "
            f"{cost.wal_bytes / DELTAS:.0f} B WAL"
        )
    return out
