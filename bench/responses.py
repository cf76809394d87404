"""Part 10, /v1 responses: what storing a response costs per call, beside the same call with
``store: false`` and in a conversation; and what a resumed stream costs the replica that
replays it. Two `turnstore serve` replicas (fake provider) on one database: calls go to A,
replays (``GET /v1/responses/{id}?stream=true``) to B, which never ran those responses."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from bench.database import libpq_url, sqlalchemy_url
from bench.dbwork import DbMeter
from bench.http import Connection, sse
from bench.server import free_port, process_cpu_s, running, turnstore_command
from bench.workload import payload

CALLS = 50  # per kind of call
STREAMED = 10  # responses replayed
REPLAYS = 200  # replays of them, 10 at once
RESPONSES = "/v1/responses"
_TABLES = ("conversations", "turns", "turn_runs", "turn_events")


@dataclass
class CallCost:
    kind: str
    rows: float  # rows added per call, over _TABLES
    bytes: float  # growth of those tables (heap, TOAST, indexes) per call
    wal_bytes: float
    transactions: float  # write transactions per call
    statements: float | None
    server_cpu_ms: float  # replica A's CPU per call


@dataclass
class ReplayCost:
    label: str
    events: float  # per replay
    server_cpu_ms: float  # replica B's CPU per replay
    statements: float | None
    p50_ms: float
    p99_ms: float


@dataclass
class ResponsesResult:
    calls: list[CallCost]
    replays: list[ReplayCost]


async def _counters(url: str) -> tuple[int, int, int, int]:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        rows = " + ".join(f"(SELECT count(*) FROM {t})" for t in _TABLES)
        size = " + ".join(f"pg_total_relation_size('{t}')" for t in _TABLES)
        row = await conn.fetchrow(
            f"SELECT pg_current_xact_id()::text::bigint, pg_current_wal_lsn() - '0/0', "
            f"{rows}, {size}"
        )
        return int(row[0]), int(row[1]), int(row[2]), int(row[3])
    finally:
        await conn.close()


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "fake-llm", **fields}).encode()


async def _post(conn: Connection, body: bytes) -> dict[str, object]:
    status, answer = await conn.request("POST", RESPONSES, body)
    if status != 200:
        raise RuntimeError(f"{status} {answer[:300]!r}")
    result: dict[str, object] = json.loads(answer)
    return result


async def _call_cost(
    url: str, pid: int, kind: str, call: Callable[[int], Awaitable[None]]
) -> CallCost:
    await call(-1)  # warm
    before, cpu = await _counters(url), process_cpu_s(pid)
    async with DbMeter(url) as meter:
        for n in range(CALLS):
            await call(n)
    cpu, after = process_cpu_s(pid) - cpu, await _counters(url)
    xacts = after[0] - before[0] - 1  # one is the second probe's own
    work = meter.per_turn(CALLS)
    return CallCost(
        kind, (after[2] - before[2]) / CALLS, (after[3] - before[3]) / CALLS,
        (after[1] - before[1]) / CALLS, xacts / CALLS, work.statements, cpu / CALLS * 1000,
    )  # fmt: skip


async def _stream(port: int, body: bytes) -> tuple[str, int]:
    """A streamed response's id and how many events it sent."""
    rid, events = "", 0
    async for head, event in sse(port, "POST", RESPONSES, body):
        if head:
            assert head["status"] == "200", head
        elif event.get("data"):
            events += 1
            data = json.loads(event["data"])
            rid = rid or data.get("response", {}).get("id", "")
    return rid, events


async def _replay(port: int, path: str) -> tuple[int, float]:
    started, events = time.perf_counter(), 0
    async for head, event in sse(port, "GET", path):
        if head:
            assert head["status"] == "200", head
        elif event.get("data"):
            events += 1
    return events, (time.perf_counter() - started) * 1000


async def _replay_cost(url: str, pid: int, port: int, label: str, paths: list[str]) -> ReplayCost:
    await _replay(port, paths[0])  # warm
    todo = [paths[n % len(paths)] for n in range(REPLAYS)]
    timings: list[tuple[int, float]] = []

    async def worker() -> None:
        while todo:
            timings.append(await _replay(port, todo.pop()))

    cpu = process_cpu_s(pid)
    async with DbMeter(url) as meter:
        await asyncio.gather(*(worker() for _ in range(10)))
    cpu = process_cpu_s(pid) - cpu
    cuts = statistics.quantiles([ms for _, ms in timings], n=100)
    events = statistics.mean(n for n, _ in timings)
    work = meter.per_turn(REPLAYS)
    return ReplayCost(label, events, cpu / REPLAYS * 1000, work.statements, cuts[49], cuts[98])


async def _measure(url: str, a: tuple[int, int], b: tuple[int, int]) -> ResponsesResult:
    (a_pid, a_port), (b_pid, b_port) = a, b
    conn = Connection(a_port)
    status, made = await conn.request("POST", "/v1/conversations", b"{}")
    assert status == 200, made
    conversation = json.loads(made)["id"]

    def text(n: int) -> str:
        return payload(n, 0).user_text

    async def relayed(n: int) -> None:
        await _post(conn, _body(input=text(n), store=False))

    async def stored(n: int) -> None:
        await _post(conn, _body(input=text(n)))

    async def in_conversation(n: int) -> None:
        await _post(conn, _body(input=text(n), conversation=conversation))

    calls = [
        await _call_cost(url, a_pid, "store: false (relayed)", relayed),
        await _call_cost(url, a_pid, "stored (no conversation)", stored),
        await _call_cost(url, a_pid, "in a conversation", in_conversation),
    ]
    await conn.close()
    streamed = [await _stream(a_port, _body(input=text(n), stream=True)) for n in range(STREAMED)]
    events = streamed[0][1]
    whole = [f"{RESPONSES}/{rid}?stream=true" for rid, _ in streamed]
    tail = [f"{path}&starting_after={events - 4}" for path in whole]
    replays = [
        await _replay_cost(url, b_pid, b_port, f"from the start ({events} events)", whole),
        await _replay_cost(url, b_pid, b_port, "starting_after: the last 3 events", tail),
    ]
    return ResponsesResult(calls, replays)


def run(url: str, log_dir: Path) -> ResponsesResult:
    ports = [free_port(), free_port()]
    env = {"DATABASE_URL": sqlalchemy_url(url), "LLM_PROVIDER": "fake"}

    def command(port: int) -> list[str]:
        return [*turnstore_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]

    with (
        running(command(ports[0]), ports[0], env, log_dir / "responses-a.log") as a,
        running(command(ports[1]), ports[1], env, log_dir / "responses-b.log") as b,
    ):
        return asyncio.run(_measure(url, (a, ports[0]), (b, ports[1])))


def lines(result: ResponsesResult) -> list[str]:
    out = [f"per call ({CALLS} sequential calls of each kind on replica A):"]
    for c in result.calls:
        statements = f"{c.statements:4.1f}" if c.statements is not None else "  - "
        out.append(
            f"  {c.kind:26} {c.rows:4.1f} rows, {c.bytes / 1024:5.1f} KiB stored, "
            f"{c.wal_bytes / 1024:5.1f} KiB WAL, {c.transactions:3.1f} write transactions, "
            f"{statements} statements, server CPU {c.server_cpu_ms:.2f} ms"
        )
    out.append(
        f"resumed streams: {REPLAYS} replays of {STREAMED} finished streamed responses, 10 at "
        "once, on replica B (which never ran them):"
    )
    for r in result.replays:
        statements = f"{r.statements:4.1f}" if r.statements is not None else "  - "
        out.append(
            f"  {r.label:36} {r.events:4.1f} events, server CPU {r.server_cpu_ms:.2f} ms, "
            f"{statements} statements, p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms per replay"
        )
    return out
