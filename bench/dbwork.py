"""What the database does per turn, measured on its own side: statements executed (from
pg_stat_statements, utility statements such as BEGIN and COMMIT included: with warm statement
caches each is one round trip) and the CPU time of the PostgreSQL server's processes.

The server's CPU is its postmaster's own and children's times (children that exited meanwhile
are in the postmaster's children times once reaped) plus every live child's: a difference of
two such samples is what the server spent between them, on every database of that server, so
the bench's own server should run nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
import psutil

from bench.database import libpq_url

_STATEMENTS = (
    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements"
    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND query NOT LIKE '%pg_stat_statements%'"
)


@dataclass(frozen=True)
class DbWork:
    statements: float | None  # per turn; None when pg_stat_statements is not loaded
    cpu_us: float  # server CPU per turn


class DbMeter:
    """``async with DbMeter(url) as meter: ...; work = meter.per_turn(turns)``"""

    def __init__(self, url: str) -> None:
        self._url = libpq_url(url)
        self._conn: asyncpg.Connection | None = None
        self._postmaster: psutil.Process | None = None
        self._cpu = 0.0
        self._statements: int | None = None
        self._spent: tuple[float, int | None] = (0.0, None)

    async def __aenter__(self) -> DbMeter:
        self._conn = await asyncpg.connect(self._url)
        backend = psutil.Process(await self._conn.fetchval("SELECT pg_backend_pid()"))
        self._postmaster = backend.parent()
        self._statements = await self._count()
        self._cpu = self._server_cpu()
        return self

    async def __aexit__(self, *exc: object) -> None:
        cpu = self._server_cpu() - self._cpu
        after = await self._count()
        statements = None if after is None or self._statements is None else after - self._statements
        self._spent = (cpu, statements)
        assert self._conn is not None
        await self._conn.close()

    def per_turn(self, turns: int) -> DbWork:
        cpu, statements = self._spent
        return DbWork(None if statements is None else statements / turns, cpu / turns * 1e6)

    async def _count(self) -> int | None:
        assert self._conn is not None
        try:
            return int(await self._conn.fetchval(_STATEMENTS))
        except asyncpg.PostgresError:  # not preloaded, or the extension is missing
            return None

    def _server_cpu(self) -> float:
        assert self._postmaster is not None
        times = self._postmaster.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in self._postmaster.children():
            try:
                own = child.cpu_times()
            except psutil.NoSuchProcess:
                continue  # gone between the listing and the read: in the children times next
            total += own.user + own.system
        return float(total)
