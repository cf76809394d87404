"""Part 11, compaction: a long conversation's per-turn cost with ``CONTEXT_STRATEGY=drop``
(the default: every earlier turn that fits the byte budget is sent) and with ``compact``, and
what a compacting turn costs.

A `turnstore serve` process (the built-in fake provider: a token is four bytes of input) for
each strategy grows ``CONVERSATIONS`` conversations to ``TURNS`` turns, one turn at a time,
with a 200 B user message per turn. Per turn: the provider's input (from the usage each
answer reports, in bytes: tokens x 4), the database blocks the turn touched in the turns table
and its TOAST (pg_statio, hits and reads, x 8 KiB: with the replica's history cache it reads
only new turns; its own insert counts too), the server's CPU and the latency; over the last
50 turns, and for compacting turns on their own.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.database import libpq_url, sqlalchemy_url
from bench.http import Connection
from bench.server import free_port, process_cpu_s, running, turnstore_command
from bench.workload import payload

CONVERSATIONS = 2
TURNS = 200
THRESHOLD_TOKENS = 20_000  # COMPACT_THRESHOLD_TOKENS for the compact run
CHAT = "/api/v1/chat"
_BLOCKS = (
    "SELECT coalesce(heap_blks_read + heap_blks_hit, 0) + coalesce(toast_blks_read, 0)"
    " + coalesce(toast_blks_hit, 0) FROM pg_statio_user_tables WHERE relname = 'turns'"
)


@dataclass
class Turned:
    input_bytes: int
    db_bytes: int
    cpu_ms: float
    ms: float
    compacted: bool


@dataclass
class StrategyResult:
    strategy: str
    turns: list[Turned] = field(default_factory=list)


async def _blocks(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval(_BLOCKS))


async def _grow(url: str, pid: int, port: int, strategy: str) -> StrategyResult:
    result = StrategyResult(strategy)
    probe = await asyncpg.connect(libpq_url(url))
    http = Connection(port)
    try:
        for n in range(CONVERSATIONS):
            cid = None
            for turn in range(TURNS):
                body = {"message": payload(n, turn).user_text, "conversation_id": cid}
                blocks, cpu = await _blocks(probe), process_cpu_s(pid)
                started = time.perf_counter()
                status, answer = await http.request("POST", CHAT, json.dumps(body).encode())
                elapsed = time.perf_counter() - started
                if status != 200:
                    raise RuntimeError(f"turn failed: {status} {answer[:300]!r}")
                done = json.loads(answer)
                cid = done["conversation_id"]
                made = await probe.fetchval(
                    "SELECT compacted IS NOT NULL FROM turns WHERE conversation_id = $1"
                    " AND seq = $2", uuid.UUID(cid), done["revision"],
                )  # fmt: skip
                result.turns.append(Turned(
                    done["usage"]["input_tokens"] * 4, (await _blocks(probe) - blocks) * 8192,
                    (process_cpu_s(pid) - cpu) * 1000, elapsed * 1000, bool(made),
                ))  # fmt: skip
    finally:
        await http.close()
        await probe.close()
    return result


def run(url: str, log_dir: Path) -> list[StrategyResult]:
    results = []
    for strategy in ("drop", "compact"):
        port = free_port()
        command = [*turnstore_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
        env = {
            "DATABASE_URL": sqlalchemy_url(url), "LLM_PROVIDER": "fake",
            "CONTEXT_STRATEGY": strategy, "COMPACT_THRESHOLD_TOKENS": str(THRESHOLD_TOKENS),
        }  # fmt: skip
        with running(command, port, env, log_dir / f"compaction-{strategy}.log") as pid:
            results.append(asyncio.run(_grow(url, pid, port, strategy)))
    return results


def _line(label: str, turns: list[Turned]) -> str:
    if not turns:
        return f"{label}: none"
    return (
        f"{label} ({len(turns)}): provider input "
        f"{statistics.mean(t.input_bytes for t in turns) / 1024:6.1f} KiB, database blocks "
        f"{statistics.mean(t.db_bytes for t in turns) / 1024:5.1f} KiB, server CPU "
        f"{statistics.mean(t.cpu_ms for t in turns):5.2f} ms, latency p50 "
        f"{statistics.median(t.ms for t in turns):5.1f} ms per turn"
    )


def lines(results: list[StrategyResult]) -> list[str]:
    out = []
    for result in results:
        per_conversation = [result.turns[n * TURNS : (n + 1) * TURNS] for n in range(CONVERSATIONS)]
        late = [t for turns in per_conversation for t in turns[-50:] if not t.compacted]
        out.append(f"CONTEXT_STRATEGY={result.strategy}")
        out.append("  " + _line(f"turns {TURNS - 50}-{TURNS}", late))
        if result.strategy == "compact":
            made = [t for t in result.turns if t.compacted]
            out.append("  " + _line("compacting turns (two provider calls)", made))
    return out
