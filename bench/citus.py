"""Part "citus": turnstore's store on a Citus coordinator with two workers (tests/support/citus.py,
all on this machine) against one plain PostgreSQL server, the same workload through the same
PostgresStore: plain turns (the lease, then the commit; each turn's place among its owner's
running turns taken and given back as served), 32 conversations x 10 turns at concurrency 16,
best of the rounds. Per turn: turns/s, round trips (every statement the store's connections
sent, counted by asyncpg's query logger: checkout pings, BEGIN and COMMIT included), and
two-phase commits (the coordinator's pg_dist_transaction, with 2PC recovery off so none is
forgotten meanwhile: 0 for a plain turn, which commits on one worker). The cluster's nodes write
as durably as the plain server (fsync, full-page writes), and all of them share this machine's
cores with the load generator.

The cluster needs Citus in the system PostgreSQL 15 (`make citus-deps`); without it the part
says why and measures nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
from sqlalchemy import event

from bench.server import ONE_OWNER
from service.core.model import Append, LeaseRequest, Turn
from service.platform import migrate
from service.platform.db import create_engine
from service.store.postgres import PostgresStore, StoreConfig
from service.store.postgres.placement import distribute
from tests.support.citus import citus_cluster, citus_database, citus_missing
from tests.support.database import asyncpg_dsn
from tests.support.turn_kinds import HELD_S, Cost, measure_all

SHARDS = 32  # per co-location group
# As durable as the plain server: the test cluster's fsync and full-page writes are off.
DURABLE = {"fsync": "on", "full_page_writes": "on"}
OWNER = "bench"


@dataclass(frozen=True)
class CitusConfig:
    conversations: int = 32
    turns: int = 10
    concurrency: int = 16
    rounds: int = 3


@dataclass
class CitusResult:
    name: str
    turns_per_s: list[float] = field(default_factory=list)
    round_trips: float = 0.0  # per turn, of the last round
    two_phase: float | None = None  # per turn (Citus only)
    error: str | None = None

    @property
    def best(self) -> float:
        return max(self.turns_per_s, default=0.0)


class _Counter:
    def __init__(self) -> None:
        self.queries = 0

    def __call__(self, _record: Any) -> None:
        self.queries += 1


def _counted(url: str, pool_size: int) -> tuple[Any, _Counter]:
    engine = create_engine(url, pool_size=pool_size)
    counter = _Counter()

    @event.listens_for(engine.sync_engine, "connect")
    def _log(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.driver_connection.add_query_logger(counter)

    return engine, counter


def _turn(n: int) -> Turn:
    reply = b'{"type":"message","role":"assistant","content":"reply %d"}' % n
    return Turn(f"message {n}", f"reply {n}", [msgspec.Raw(reply)])


async def _conversation(store: PostgresStore, cid: uuid.UUID, turns: int) -> None:
    first = uuid.uuid4()  # a first turn takes its place among the owner's running turns
    assert await store.places.take_turn(OWNER, first, 30), "the limit is far"
    await store.history.append(Append(cid, _turn(0), 0, owner=OWNER, lease=first))
    for revision in range(1, turns):
        holder = uuid.uuid4()
        lease = LeaseRequest(cid, OWNER, holder, lease_s=30, queue=False, after_revision=revision)
        taken = await store.history.lease(lease)
        assert taken.acquired, "nothing else runs: the lease is free"
        await store.history.append(
            Append(cid, _turn(revision), revision, owner=OWNER, lease=holder)
        )


async def _worker(store: PostgresStore, waiting: list[uuid.UUID], turns: int) -> None:
    while waiting:
        await _conversation(store, waiting.pop(), turns)


async def _two_phase(url: str) -> int | None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        if not await conn.fetchval("SELECT to_regclass('pg_dist_transaction') IS NOT NULL"):
            return None
        return int(await conn.fetchval("SELECT count(*) FROM pg_dist_transaction"))
    finally:
        await conn.close()


async def measure(name: str, url: str, config: CitusConfig) -> CitusResult:
    result = CitusResult(name)
    engine, counter = _counted(url, config.concurrency)
    # Each turn counted among its owner's running turns, as served (OWNER_MAX_RUNNING_TURNS).
    running = StoreConfig(running_turns=int(ONE_OWNER["OWNER_MAX_RUNNING_TURNS"]))
    store = PostgresStore.over(engine, running)
    try:
        await _conversation(store, uuid.uuid4(), 3)  # warm-up: connections, statements
        for _ in range(config.rounds):
            cids = [uuid.uuid4() for _ in range(config.conversations)]
            before_2pc, before = await _two_phase(url), counter.queries
            started = time.perf_counter()

            await asyncio.gather(
                *(_worker(store, cids, config.turns) for _ in range(config.concurrency))
            )
            elapsed = time.perf_counter() - started
            turns = config.conversations * config.turns
            result.turns_per_s.append(turns / elapsed)
            result.round_trips = (counter.queries - before) / turns
            after_2pc = await _two_phase(url)
            if before_2pc is not None and after_2pc is not None:
                result.two_phase = (after_2pc - before_2pc) / turns
    except Exception as exc:  # reported, not fatal to the other parts
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        await engine.dispose()
    return result


@contextmanager
def citus_url() -> Iterator[str]:
    """A migrated, placed database on a fresh local cluster (stopped on the way out)."""
    with citus_cluster(settings=DURABLE) as cluster, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=SHARDS))
        yield url


@dataclass
class Kinds:
    """Every kind of turn once through one replica over HTTP (tests/support/turn_kinds.py),
    at once and held by its provider for HELD_S (everything it holds renewed meanwhile); and
    where the one owner's conversations of the part are (``spread``: worker port -> count)."""

    plain: dict[str, Cost]
    citus: dict[str, Cost]
    plain_held: dict[str, Cost]
    citus_held: dict[str, Cost]
    spread: dict[int, int] = field(default_factory=dict)


# The worker of each of an owner's conversations, counted (the coordinator's metadata only).
SPREAD = """
    SELECT s.nodeport, count(*) AS conversations
    FROM unnest(CAST($1 AS uuid[])) AS c(id)
    JOIN citus_shards s ON s.table_name = 'conversations'::regclass
        AND s.shardid = get_shard_id_for_distribution_column('conversations', c.id)
    GROUP BY s.nodeport ORDER BY s.nodeport
"""


async def _spread(url: str, owner: str) -> dict[int, int]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        cids = [
            r["id"]
            for r in await conn.fetch("SELECT id FROM conversations WHERE owner = $1", owner)
        ]
        return {r["nodeport"]: r["conversations"] for r in await conn.fetch(SPREAD, cids)}
    finally:
        await conn.close()


def run(plain_url: str, config: CitusConfig) -> tuple[list[CitusResult], Kinds] | str:
    """Both measured, plain first; or why Citus could not be measured."""
    if (missing := citus_missing()) is not None:
        return missing
    plain = asyncio.run(measure("plain PostgreSQL (one server)", plain_url, config))
    plain_kinds = asyncio.run(measure_all(plain_url, 0.0))
    plain_held = asyncio.run(measure_all(plain_url))
    with citus_url() as url:
        citus = asyncio.run(measure("Citus (coordinator + 2 workers)", url, config))
        kinds = Kinds(plain_kinds, asyncio.run(measure_all(url, 0.0)), plain_held, {})
        kinds.citus_held = asyncio.run(measure_all(url))
        kinds.spread = asyncio.run(_spread(url, OWNER))
    return [plain, citus], kinds


def lines(measured: tuple[list[CitusResult], Kinds] | str) -> list[str]:
    if isinstance(measured, str):
        return [f"   not measured: {measured}"]
    results, kinds = measured
    out = [f"   {'':34} {'turns/s':>9} {'round trips/turn':>17} {'2PC/turn':>9}"]
    for r in results:
        if r.error:
            out.append(f"   {r.name:34} failed: {r.error}")
            continue
        two_phase = "-" if r.two_phase is None else f"{r.two_phase:.2f}"
        out.append(f"   {r.name:34} {r.best:9.0f} {r.round_trips:17.2f} {two_phase:>9}")
    out.append(
        f"   Each kind of turn once over HTTP (one replica): round trips, and the coordinator's"
        f" prepared transactions (2PC); answered at once, and held {HELD_S:.0f} s (renewals)"
    )
    head = f"   {'':36} {'PG':>4} {'Citus':>6} {'2PC':>4} | {'PG':>4} {'Citus':>6} {'2PC':>4}"
    out.append(head)
    for name, cost in kinds.citus.items():
        held = kinds.citus_held[name]
        out.append(
            f"   {name:36} {kinds.plain[name].round_trips:4} {cost.round_trips:6}"
            f" {cost.two_phase:4} | {kinds.plain_held[name].round_trips:4}"
            f" {held.round_trips:6} {held.two_phase:4}"
        )
    where = ", ".join(f"{count} on the worker at :{port}" for port, count in kinds.spread.items())
    out.append(
        f"   one owner's {sum(kinds.spread.values())} conversations (the store's above, all"
        f" '{OWNER}'s): {where}"
    )
    return out
