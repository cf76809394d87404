"""The printed figures: one table per part, then the issue's targets as measured ratios."""

from __future__ import annotations

from collections.abc import Iterator

from bench.e2e import E2EResult
from bench.holding import HoldingResult
from bench.hostile import HostileResult
from bench.store import HISTORY_POINTS, SIZE_SPANS, StoreResult

CACHED, UNCACHED, BASELINE = "turnstore", "turnstore-nocache", "asyncpg-baseline"


def store_table(results: list[StoreResult]) -> Iterator[str]:
    points = " / ".join(str(h) for h in HISTORY_POINTS)
    spans = ", ".join(f"h {a}-{b}" for a, b in SIZE_SPANS)
    yield (
        f"{'subject':19} {'turns/s best (rounds)':>25} {'client CPU':>11} {'DB CPU':>11} "
        f"{'stmts':>5}   ms/turn at history {points:<26} B/turn ({spans})"
    )
    for r in results:
        if r.error:
            yield f"{r.name:19} not measured: {r.error}"
            continue
        rounds = ", ".join(f"{x:.0f}" for x in r.turns_per_s)
        cpu = f"{min(r.cpu_us):.0f} us/turn"
        db = f"{min(r.db_cpu_us):.0f} us/turn"
        statements = "-" if r.statements is None else f"{r.statements:.2f}"
        latency = " / ".join(f"{r.latency_ms[h]:.1f}" for h in HISTORY_POINTS)
        sizes = ", ".join(f"{r.bytes_per_turn[s]:,.0f}" for s in SIZE_SPANS)
        throughput = f"{r.best_turns_per_s:5.0f} ({rounds:>17})"
        yield (
            f"{r.name:19} {throughput} {cpu:>12} {db:>11} {statements:>5}   {latency:>45}   {sizes}"
        )
    yield (
        "  (DB CPU: the PostgreSQL server's processes, per turn; stmts: statements per turn "
        "from pg_stat_statements, BEGIN/COMMIT included: round trips with warm caches)"
    )


def e2e_lines(e2e: E2EResult, results: dict[str, StoreResult]) -> Iterator[str]:
    yield (
        f"--workers {e2e.workers}: HTTP turns/s {e2e.turns_per_s:.0f}, "
        f"latency p50 {e2e.p50_ms:.1f} ms, p99 {e2e.p99_ms:.1f} ms; "
        f"server CPU {e2e.server_cpu_ms:.2f} ms per turn"
    )
    if e2e.db is not None:
        statements = "-" if e2e.db.statements is None else f"{e2e.db.statements:.2f}"
        yield (
            f"  database per HTTP turn: {statements} statements (round trips), "
            f"{e2e.db.cpu_us:.0f} us of server CPU"
        )
    for name in (CACHED, BASELINE):
        if name in results and not results[name].error:
            store = results[name].best_turns_per_s
            yield f"  beside the store figure of this run: {name} {store:.0f} turns/s"


def scale_lines(one: E2EResult, two: E2EResult | None, cpus: int) -> Iterator[str]:
    """How far one PostgreSQL carries a fleet, from this run's CPU per turn."""
    if one.db is None:
        return
    per_db_core = 1e6 / one.db.cpu_us
    per_replica_core = 1000 / one.server_cpu_ms
    yield (
        f"one PostgreSQL core: {per_db_core:,.0f} turns/s ({one.db.cpu_us:.0f} us of database "
        "CPU per HTTP turn)"
    )
    yield (
        f"one replica core: {per_replica_core:,.0f} turns/s ({one.server_cpu_ms:.2f} ms per "
        f"turn), so one database core feeds {per_db_core / per_replica_core:.1f} replica cores"
    )
    if two is not None:
        yield (
            f"measured: --workers 2 {two.turns_per_s:.0f} turns/s against --workers 1 "
            f"{one.turns_per_s:.0f} ({two.turns_per_s / one.turns_per_s:.2f}x), on {cpus} cores "
            "that the database and the load generator share"
        )


def holding_lines(h: HoldingResult) -> Iterator[str]:
    problems = {k: v for k, v in h.outcomes.items() if k != "done"}
    yield (
        f"{h.completed} of {h.streams} streams committed in {h.seconds:.1f} s; "
        f"other outcomes: {problems or 'none'}"
    )
    yield (
        f"server RSS {h.rss_before_mb:.0f} MB before, {h.rss_peak_mb:.0f} MB peak "
        f"(+{h.rss_growth_mb:.0f} MB)"
    )
    yield (
        f"database connections: at most {h.connections_open_max} open, "
        f"{h.connections_busy_max} busy at once (DB_POOL_SIZE {h.pool_size}, no overflow)"
    )


def _check(label: str, value: float, limit: float, at_least: bool, unit: str = "x") -> str:
    met = value >= limit if at_least else value <= limit
    sign = ">=" if at_least else "<="
    verdict = "met" if met else "MISSED"
    return f"  {label:55} {value:8.2f}{unit:<3} (target {sign} {limit:g}{unit})  {verdict}"


def floor_targets(ratios: dict[tuple[str, str], tuple[float, float, float]]) -> Iterator[str]:
    """turnstore's server CPU per turn over each floor's, of the rounds' minimums (of their
    medians beside it)."""
    for (kind, floor), (of_min, of_median, limit) in ratios.items():
        against = f"turnstore's {floor} turn" if floor.startswith("/") else f"{floor} floor"
        label = f"{kind} server CPU/turn vs {against} (medians {of_median:.2f}x)"
        yield _check(label, of_min, limit, False)


def targets(
    results: dict[str, StoreResult],
    e2e: E2EResult | None,
    hold: HoldingResult | None,
    hostile: HostileResult | None = None,
) -> Iterator[str]:
    if hostile:
        worst = max(hostile.cpu_ms.values())
        yield _check("hostile: worst 1 MiB body, server CPU per request", worst, 50, False, "ms")
        refused = all(s and max(s) < 500 and min(s) >= 400 for s in hostile.statuses.values())
        yield _check("hostile: bodies refused with a 4xx", float(refused), 1, True, "")
    ours = results.get(CACHED)
    if ours is None or ours.error:
        yield "  turnstore's store was not measured: no ratios"
        return

    def ratio_to(name: str) -> float | None:
        other = results.get(name)
        if other is None or other.error or not other.best_turns_per_s:
            return None
        return ours.best_turns_per_s / other.best_turns_per_s

    for name, limit in ((BASELINE, 1.0), ("agents-sqlalchemy", 2), ("langgraph", 5)):
        value = ratio_to(name)
        label = f"store throughput vs {name}"
        yield _check(label, value, limit, True) if value else f"  {label}: not measured"
    in_clear = ratio_to("turnstore-encrypted")  # ours (in clear) / encrypted
    if in_clear:  # encrypting costs at most 10% of the store's throughput
        yield _check("store throughput, encrypted vs in clear", 1 / in_clear, 0.9, True)
    first, last = HISTORY_POINTS[0], HISTORY_POINTS[-1]
    growth = ours.latency_ms[last] / ours.latency_ms[first]
    yield _check(f"store latency at {last} vs {first} turns of history", growth, 1.5, False)
    late = SIZE_SPANS[-1]
    baseline = results.get(BASELINE)
    if baseline and not baseline.error:
        size = ours.bytes_per_turn[late] / baseline.bytes_per_turn[late]
        yield _check("stored bytes per turn vs the baseline's (h 150-200)", size, 1.1, False)
    flat = ours.bytes_per_turn[late] / ours.bytes_per_turn[SIZE_SPANS[0]]
    yield _check("stored bytes per turn, h 150-200 vs h 0-50", flat, 1.1, False)
    if baseline and not baseline.error:
        value = min(ours.db_cpu_us) / min(baseline.db_cpu_us)
        yield _check("store: database CPU per turn vs the baseline's", value, 1.0, False)
    if e2e and e2e.db is not None and e2e.db.statements is not None:
        yield _check("HTTP turn (warm): database round trips", e2e.db.statements, 2, False, "")
    if e2e:
        yield _check("HTTP turn: server CPU", e2e.server_cpu_ms, 0.6, False, "ms")
    if e2e and baseline and not baseline.error:
        value = e2e.turns_per_s / baseline.best_turns_per_s
        yield _check("end-to-end HTTP turns/s vs the store baseline's", value, 0.5, True)
    if hold:
        yield _check("holding: streams not committed", hold.streams - hold.completed, 0, False, "")
        yield _check(
            "holding: max connections open vs DB_POOL_SIZE",
            hold.connections_open_max,
            hold.pool_size,
            False,
            "",
        )
        yield _check("holding: peak RSS growth", hold.rss_growth_mb, 150, False, "MB")
