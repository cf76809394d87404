"""Part 15, finding and moving conversations: what a page of GET /api/v1/conversations costs
with each filter, for an owner with 10 conversations and for one with 1,000,000 (rows made in
bulk by SQL, each with its search terms as a turn's commit makes them), the query plans, and
the memory an export of a 30 MB conversation holds.

The page is read through the store port the route calls (PostgresReads.list_conversations,
its prepared statements as a replica runs them: a generic plan after five runs included),
20 times after 5 warm-ups, the median reported.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import msgspec

from bench.database import fresh_database, libpq_url, sqlalchemy_url
from service.core.export_lines import Imported
from service.core.model import Origin, Turn
from service.core.search import Finding
from service.platform.db import create_engine
from service.store.postgres import PostgresStore
from service.store.postgres import terms as search_terms
from service.usecases.exporting import exported

BIG = 1_000_000
SMALL = 10
RUNS, WARM = 20, 5
EXPORT_BYTES = 30 * 1024 * 1024
# Each conversation: words "all", "w<i % 1000>" (1 in 1,000), "u<i>" (its own), model m<i % 2>,
# metadata {"team": "t<i % 10>"}.
FILL = """
    INSERT INTO conversations (id, revision, created_at, updated_at, owner, context_start,
        metadata, search)
    SELECT gen_random_uuid(), 1, now() - make_interval(secs => i), now() - make_interval(secs => i),
        $1, 1, json_build_object('team', 't' || (i % 10)),
        strip(to_tsvector('simple', 'all w' || (i % 1000) || ' u' || i))
        || array_to_tsvector(ARRAY[
            '_o' || left(encode(sha256(convert_to('o:m' || (i % 2), 'UTF8')), 'hex'), 32),
            '_m' || left(encode(sha256(convert_to(
                'm:' || json_build_array('team', 't' || (i % 10))::text, 'UTF8')), 'hex'), 32)])
    FROM generate_series(1, $2) AS i
"""
QUERIES: dict[str, Finding | None] = {
    "no filter": None,
    "q, every conversation": Finding(q="all"),
    "q, 1 in 1,000": Finding(q="w7"),
    "q, one conversation": Finding(q="u77"),
    "q, none": Finding(q="nowhere"),
    "model (half)": Finding(model="m1"),
    "metadata (1 in 10)": Finding(metadata=(("team", "t3"),)),
    "q + metadata": Finding(q="w7", metadata=(("team", "t7"),)),
    "created_after (last hour)": Finding(created_after=datetime.now(UTC) - timedelta(hours=1)),
    "updated_before (older)": Finding(updated_before=datetime.now(UTC) - timedelta(days=2)),
}


async def _page_ms(store: PostgresStore, owner: str, finding: Finding | None) -> float:
    times = []
    for n in range(WARM + RUNS):
        started = time.perf_counter()
        await store.reads.list_conversations(owner, 20, None, finding)
        if n >= WARM:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def _plans(conn: asyncpg.Connection, store: PostgresStore, owner: str) -> dict[str, str]:
    plans = {}
    for name, finding in QUERIES.items():
        filters, params = search_terms.query(None, finding) if finding else ((), {})
        statement = store.db.sql.listing(filters)
        params |= {"caller": owner, "limit": 20, "before_at": datetime.max.replace(tzinfo=UTC),
                   "before_id": "ffffffff-ffff-ffff-ffff-ffffffffffff"}  # fmt: skip
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + statement.sql,
            *statement.args(params),
        )
        plans[name] = "\n".join(row[0] for row in rows)
    return plans


def _big_conversation() -> Imported:
    """About 30 MB stored: 300 turns of 50 KB messages and their items."""
    said, when, turns = "word " * 10_000, datetime.now(UTC), []
    for n in range(1, 301):
        item = msgspec.json.encode({"type": "message", "role": "user", "content": said})
        turns.append(
            Turn(
                said,
                said,
                [msgspec.Raw(item)],
                origin=Origin("fake", "", "m1"),
                created_at=when,
                number=n,
            )
        )
    return Imported({}, 300, 1, turns)


async def _export_peak(store: PostgresStore) -> tuple[int, int, int]:
    imported = _big_conversation()
    info = await store.edits.import_conversation("exporter", imported)
    del imported
    tracemalloc.start()
    size = 0
    try:
        async for line in exported(store.reads, info, "exporter"):
            size += len(line)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return info.stored_bytes or 0, size, peak


async def _run(url: str) -> dict[str, Any]:
    engine = create_engine(sqlalchemy_url(url), pool_size=2)
    store = PostgresStore.over(engine)
    conn = await asyncpg.connect(libpq_url(url))
    result: dict[str, Any] = {"empty": {}, "full": {}}
    try:
        await conn.execute(FILL, "small", SMALL)
        await conn.execute("ANALYZE conversations")
        for name, finding in QUERIES.items():
            result["empty"][name] = await _page_ms(store, "small", finding)
        started = time.perf_counter()
        await conn.execute(FILL, "big", BIG)
        await conn.execute("VACUUM ANALYZE conversations")
        result["fill_s"] = time.perf_counter() - started
        for name, finding in QUERIES.items():
            result["full"][name] = (
                await _page_ms(store, "small", finding),
                await _page_ms(store, "big", finding),
            )
        result["plans"] = await _plans(conn, store, "big")
        result["export"] = await _export_peak(store)
    finally:
        await conn.close()
        await engine.dispose()
    return result


def run(server_url: str, logs: Path) -> dict[str, Any]:
    with fresh_database(server_url) as url:
        return asyncio.run(_run(url))


def lines(result: dict[str, Any]) -> list[str]:
    head = f"   {'filter':<28} {'10 alone':>10} {'10 of 1M rows':>14} {'1,000,000':>10}"
    out = [f"   {BIG:,} conversations made in {result['fill_s']:.0f} s (terms and indexes too)",
           head + "  (ms a page of 20)"]  # fmt: skip
    for name in QUERIES:
        small, big = result["full"][name]
        out.append(f"   {name:<28} {result['empty'][name]:>10.2f} {small:>14.2f} {big:>10.2f}")
    stored, size, peak = result["export"]
    out.append(
        f"   export of a {stored / 2**20:.0f} MiB conversation ({size / 2**20:.0f} MiB of ndjson):"
        f" {peak / 2**20:.1f} MiB held at most (tracemalloc peak)"
    )
    return out


def plans(result: dict[str, Any]) -> str:
    return "\n\n".join(f"-- {name}\n{plan}" for name, plan in result["plans"].items())


if __name__ == "__main__":
    import sys

    from bench.database import server

    with server() as base:
        found = run(base, Path("."))
    print("\n".join(lines(found)))
    if "--plans" in sys.argv:
        print(plans(found))
