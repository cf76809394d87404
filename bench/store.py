"""Part 1, the store: throughput under concurrency, latency against history length, and
stored bytes per turn, for one subject at a time on the same database."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field

from bench.database import relation_bytes, settle
from bench.dbwork import DbMeter
from bench.stores import Subject, opener
from bench.workload import payload

HISTORY_POINTS = (1, 10, 50, 100, 200)
WINDOW = 5  # latency at history h: the median of the turns with h .. h+WINDOW-1 earlier turns
SIZE_SPANS = ((0, 50), (150, 200))  # stored bytes per turn over these history ranges


@dataclass
class StoreResult:
    name: str
    turns_per_s: list[float] = field(default_factory=list)  # one per round
    cpu_us: list[float] = field(default_factory=list)  # this process's CPU per turn, per round
    db_cpu_us: list[float] = field(default_factory=list)  # the database server's, per round
    statements: float | None = None  # per turn (pg_stat_statements), of the last round
    latency_ms: dict[int, float] = field(default_factory=dict)
    bytes_per_turn: dict[tuple[int, int], float] = field(default_factory=dict)
    error: str | None = None

    @property
    def best_turns_per_s(self) -> float:
        return max(self.turns_per_s) if self.turns_per_s else 0.0


async def throughput(subject: Subject, conversations: int, turns: int, concurrency: int) -> float:
    """turns/s with ``concurrency`` workers, each running whole conversations turn by turn."""
    waiting = [uuid.uuid4() for _ in range(conversations)]
    # Made before the clock starts: generating them is not what is measured.
    work = {cid: [payload(n, h) for h in range(turns)] for n, cid in enumerate(waiting)}

    async def worker() -> None:
        while waiting:
            cid = waiting.pop()
            for history, content in enumerate(work[cid]):
                await subject.turn(cid, content, history)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return conversations * turns / (time.perf_counter() - start)


async def ladder(subject: Subject, url: str, conversations: int, result: StoreResult) -> None:
    """Grow ``conversations`` conversations in lockstep to 200+WINDOW turns, one turn at a
    time (no concurrency); time every turn and snapshot the stored bytes on the way."""
    cids = [uuid.uuid4() for _ in range(conversations)]
    samples: dict[int, list[float]] = {h: [] for h in HISTORY_POINTS}
    sizes: dict[int, int] = {}
    marks = {h for span in SIZE_SPANS for h in span}
    for history in range(max(HISTORY_POINTS) + WINDOW):
        if history in marks:
            sizes[history] = await relation_bytes(url, subject.tables)
        for n, cid in enumerate(cids):
            work = payload(1000 + n, history)
            start = time.perf_counter()
            await subject.turn(cid, work, history)
            elapsed = time.perf_counter() - start
            for point in HISTORY_POINTS:
                if point <= history < point + WINDOW:
                    samples[point].append(elapsed)
    for point, values in samples.items():
        result.latency_ms[point] = statistics.median(values) * 1000
    for first, last in SIZE_SPANS:
        grown = sizes[last] - sizes[first]
        result.bytes_per_turn[(first, last)] = grown / ((last - first) * conversations)


async def run_subject(label: str, url: str, config: StoreConfig) -> StoreResult:
    result = StoreResult(label)
    try:
        subject = await opener(label)(url)
    except Exception as exc:  # an uninstallable or broken peer is reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    try:
        await throughput(subject, 4, 3, 4)  # warm-up: connections, prepared statements
        await settle(url)
        await ladder(subject, url, config.ladder_conversations, result)
        for _ in range(config.rounds):
            await settle(url)
            cpu = time.process_time()
            async with DbMeter(url) as meter:
                result.turns_per_s.append(
                    await throughput(
                        subject, config.conversations, config.turns, config.concurrency
                    )
                )
            turns = config.conversations * config.turns
            result.cpu_us.append((time.process_time() - cpu) / turns * 1e6)
            work = meter.per_turn(turns)
            result.db_cpu_us.append(work.cpu_us)
            result.statements = work.statements
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        await subject.close()
    return result


@dataclass(frozen=True)
class StoreConfig:
    conversations: int = 64
    turns: int = 20
    concurrency: int = 32
    rounds: int = 3
    ladder_conversations: int = 3
