"""Part 13: what the fleet-wide running-turn count (OWNER_MAX_RUNNING_TURNS) costs a turn.

Part 2's load (64 conversations x 20 plain turns at concurrency 32, one owner) on one
database, in alternating rounds: as shipped (every turn takes its counted place: a warm turn
inside its lease statement, a first turn by a statement of its own; the commit gives it back),
and with ``turnstore_take_turn()`` replaced by one that counts nothing (no lock, no count, no
row): the statements stay as they are, only the count's work goes. The function is restored
after the run. Per turn: database round trips, the database's CPU, the server's CPU.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from bench import e2e
from bench.database import admin, libpq_url
from bench.e2e import E2EResult
from service.platform import migrate
from service.store.postgres.placement import FUNCTIONS

ROUNDS = 3
# The shipped function's signature, and one that takes every place at once.
SIGNATURE = FUNCTIONS["turnstore_take_turn"].signature
UNCOUNTED = """
CREATE OR REPLACE FUNCTION turnstore_take_turn(p_owner text, p_holder uuid, p_now timestamptz,
    p_until timestamptz, p_most integer, OUT taken boolean)
RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN taken := true; END $$
"""


@dataclass(frozen=True)
class RunningResult:
    counted: list[E2EResult]
    uncounted: list[E2EResult]


async def _definition(url: str) -> str:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        found: str = await conn.fetchval("SELECT pg_get_functiondef($1::regprocedure)", SIGNATURE)
        return found
    finally:
        await conn.close()


def run(url: str, log_dir: Path) -> RunningResult:
    migrate.upgrade(url)  # the function must exist to be read
    shipped = asyncio.run(_definition(url))
    counted, uncounted = [], []
    try:
        for n in range(ROUNDS):
            asyncio.run(admin(url, shipped))
            counted.append(e2e.run(url, log_dir, 0, name=f"running-counted-{n}"))
            asyncio.run(admin(url, UNCOUNTED))
            uncounted.append(e2e.run(url, log_dir, 0, name=f"running-uncounted-{n}"))
    finally:
        asyncio.run(admin(url, shipped))
    return RunningResult(counted, uncounted)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _figures(results: list[E2EResult]) -> tuple[float | None, float | None, float, float]:
    return (
        _median([r.db.statements if r.db else None for r in results]),
        _median([r.db.cpu_us if r.db else None for r in results]),
        statistics.median(r.server_cpu_ms for r in results),
        statistics.median(r.turns_per_s for r in results),
    )


def lines(result: RunningResult) -> Iterator[str]:
    yield (
        f"{'':26} {'round trips/turn':>17} {'DB CPU us/turn':>15} {'server CPU ms/turn':>19}"
        f" {'turns/s':>8}   (medians of {ROUNDS} alternating rounds)"
    )
    rows = {"counted (as shipped)": result.counted, "count removed": result.uncounted}
    figures = {label: _figures(results) for label, results in rows.items()}
    for label, (trips, db_cpu, cpu, rate) in figures.items():
        shown_trips = "-" if trips is None else f"{trips:.2f}"
        shown_db = "-" if db_cpu is None else f"{db_cpu:.0f}"
        yield f"{label:26} {shown_trips:>17} {shown_db:>15} {cpu:>19.2f} {rate:>8.0f}"
    (trips, db_cpu, cpu, _), (trips0, db_cpu0, cpu0, _) = figures.values()
    if trips is not None and trips0 is not None and db_cpu is not None and db_cpu0 is not None:
        yield (
            f"the count costs a turn {trips - trips0:+.2f} round trips, {db_cpu - db_cpu0:+.0f} us"
            f" of database CPU and {cpu - cpu0:+.2f} ms of server CPU (first turns, 1 in 20"
            " here, pay its one statement)"
        )
