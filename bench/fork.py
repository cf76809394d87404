"""Part 6, forks: what forking a conversation costs, by its length. Conversations of 10, 50 and
200 turns of the issue's workload (turnstore's PostgresStore, as served); each is forked at
its last turn, 20 times, timed from the client; the fork's WAL bytes from
``pg_current_wal_lsn()`` (the copy is one INSERT ... SELECT on the server: no turn passes
through the process)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator

import asyncpg
import msgspec

from bench.database import libpq_url, sqlalchemy_url
from bench.workload import payload
from service.core.model import Append, Turn
from service.platform.db import create_engine
from service.store.postgres import PostgresStore

LENGTHS = (10, 50, 200)
FORKS = 20


async def _grow(store: PostgresStore, turns: int, number: int) -> uuid.UUID:
    cid = uuid.uuid4()
    for seq in range(1, turns + 1):
        p = payload(number, seq)
        items = [msgspec.Raw(raw) for raw in p.raw_items]
        await store.history.append(Append(cid, Turn(p.user_text, p.assistant_text, items), seq - 1))
    return cid


async def _measure(url: str) -> list[tuple[int, float, float, float]]:
    engine = create_engine(sqlalchemy_url(url))
    store = PostgresStore.over(engine)
    probe = await asyncpg.connect(libpq_url(url))
    rows = []
    try:
        for number, turns in enumerate(LENGTHS):
            cid = await _grow(store, turns, 9000 + number)
            took, wal = [], []
            for _ in range(FORKS):
                before = await probe.fetchval("SELECT pg_current_wal_lsn()")
                started = time.perf_counter()
                await store.edits.fork(cid, "anonymous", turns)
                took.append((time.perf_counter() - started) * 1000)
                after = await probe.fetchval("SELECT pg_current_wal_lsn()")
                wal.append(await probe.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", after, before))
            rows.append(
                (turns, statistics.median(took), max(took), statistics.median(map(float, wal)))
            )
    finally:
        await probe.close()
        await engine.dispose()
    return rows


def run(url: str) -> list[tuple[int, float, float, float]]:
    return asyncio.run(_measure(url))


def lines(rows: list[tuple[int, float, float, float]]) -> Iterator[str]:
    yield f"{'turns':>6} {'fork p50 ms':>12} {'max ms':>8} {'WAL per fork':>14}"
    for turns, p50, worst, wal in rows:
        yield f"{turns:>6} {p50:>12.1f} {worst:>8.1f} {wal / 1024:>11.0f} KiB"
