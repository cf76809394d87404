"""The floors part: turnstore's server CPU per turn against two floors that do the same
database work on the same server stack, in the same run (bench/floors/README in
bench/README.md, "8. Floors").

Three servers run side by side on the bench's database, each one uvicorn worker with httptools
and uvloop: ``turnstore serve`` (fake provider, default settings), the bare ASGI floor and the
Litestar floor. Round by round (the subjects' order rotating), each gets the same load of each
kind of turn (bench/floors/load.py) while its process's CPU time, the database's CPU time and
the statements it ran (pg_stat_statements) are counted. Afterwards the rows every subject
wrote are compared with turnstore's."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.database import libpq_url, settle, sqlalchemy_url
from bench.dbwork import DbMeter
from bench.floors import flame, load
from bench.server import free_port, process_cpu_s, running, turnstore_command

SUBJECTS = ("bare", "litestar", "turnstore")
FLOOR_APPS = {"bare": "bench.floors.bare:create", "litestar": "bench.floors.litestar_app:create"}
# turnstore / floor, server CPU per turn: the targets.
TARGETS = {"litestar": 1.5, "bare": 2.5}
CONVERSATIONS, TURNS, CONCURRENCY = 64, 20, 32  # part 2's load


@dataclass
class Measured:
    cpu_ms: list[float] = field(default_factory=list)  # server CPU per turn, one per round
    turns_per_s: list[float] = field(default_factory=list)
    db_cpu_us: list[float] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)  # statements by label, all rounds
    turns: int = 0  # all rounds
    conversations: list[dict[int, str]] = field(default_factory=list)  # per round

    @property
    def cpu(self) -> tuple[float, float]:
        return min(self.cpu_ms), statistics.median(self.cpu_ms)

    def per_turn(self) -> dict[str, float]:
        return {label: calls / self.turns for label, calls in self.calls.items()}


@dataclass
class FloorsResult:
    rounds: int
    measured: dict[tuple[str, str], Measured]  # (kind, subject)
    rows: dict[tuple[str, str], tuple[int, int]]  # (kind, subject) -> (as turnstore's, of)
    realtime: bool = False  # the servers ran under SCHED_FIFO
    profiles: list[Profile] = field(default_factory=list)


def _command(subject: str, port: int) -> list[str]:
    if subject == "turnstore":
        where = ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        return [*turnstore_command(), "serve", *where]
    return [
        sys.executable, "-m", "uvicorn", "--factory", FLOOR_APPS[subject],
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--http", "httptools", "--loop", "uvloop", "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip


# pg_stat_statements' text of a statement -> what it is (the first pattern that matches).
_LABELS = (
    (r"^WITH attempt AS", "lease (+ turns after the cached revision)"),
    (
        r"^SELECT revision, created_at, updated_at, lease_wanted FROM turnstore_commit",
        "commit (bump or new conversation, turn row, idempotency key)",
    ),
    (r"^SELECT conversations\.revision", "load (the check before a stream starts)"),
    (r"^INSERT INTO turn_runs", "run: create"),
    (r"^UPDATE turn_runs SET status = \$\d+ WHERE id", "run: begin"),
    (r"^WITH r AS \(UPDATE turn_runs SET last_event", "run: log events"),
    (r"^WITH r AS \(UPDATE turn_runs SET status = \$\d+, revision", "run: end, in the commit"),
    (r"^WITH r AS \(UPDATE turn_runs SET status = \$\d+, error_code", "run: end (END)"),
    (r"^SELECT r\.id, r\.conversation_id", "run: read its events (READ_EVENTS)"),
    (r"^UPDATE turn_runs SET heartbeat_until", "run: heartbeats"),
    (r"^UPDATE conversations c SET lease_expires_at", "lease: renew"),
    (r"^BEGIN", "BEGIN"),
    (r"^COMMIT", "COMMIT"),
)


def label(query: str) -> str:
    text = " ".join(query.split()).replace("( ", "(")
    for pattern, name in _LABELS:
        if re.match(pattern, text):
            return name
    return text[:60]


_CALLS = (
    "SELECT queryid, calls, query FROM pg_stat_statements"
    " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND query NOT LIKE '%pg_stat_statements%'"
)


async def _calls(url: str) -> dict[int, tuple[int, str]] | None:
    conn = await asyncpg.connect(libpq_url(url))
    try:
        rows = await conn.fetch(_CALLS)
    except asyncpg.PostgresError:
        return None  # pg_stat_statements is not loaded
    finally:
        await conn.close()
    return {row["queryid"]: (row["calls"], row["query"]) for row in rows}


async def _measure(kind: str, port: int, pid: int, url: str, into: Measured) -> None:
    warm = await load.prepare(kind, port, 4)
    await load.run(kind, port, warm, 3, 4)
    starts = await load.prepare(kind, port, CONVERSATIONS)
    await settle(url)
    before = await _calls(url)
    cpu = process_cpu_s(pid)
    async with DbMeter(url) as meter:
        done = await load.run(kind, port, starts, TURNS, CONCURRENCY)
    cpu = process_cpu_s(pid) - cpu
    after = await _calls(url)
    into.cpu_ms.append(cpu / done.turns * 1000)
    into.turns_per_s.append(done.turns / done.seconds)
    into.db_cpu_us.append(meter.per_turn(done.turns).cpu_us)
    into.turns += done.turns
    into.conversations.append(done.conversations)
    if before is not None and after is not None:
        for queryid, (calls, query) in after.items():
            ran = calls - before.get(queryid, (0, ""))[0]
            if ran:
                into.calls[label(query)] += ran


# Each conversation's rows in one digest: its turns (all stored columns but the turn's run id,
# which is random), its revision, window start and lease; for streamed turns the runs'
# statuses and logged delta batches too.
_DIGEST = """
SELECT c.id, c.revision || ':' || c.context_start || ':' || (c.lease_holder IS NULL) || ':' ||
  (SELECT md5(string_agg(concat_ws('|', t.seq, t.user_message, t.assistant_message,
     t.replay_items::text, t.provider, t.endpoint, t.model, t.context_from, t.prompt_version,
     t.tool_calls::text, t.status, t.incomplete_reason, t.turn_id IS NULL,
     t.sealed_replay_items IS NULL), '#' ORDER BY t.seq))
   FROM turns t WHERE t.conversation_id = c.id) || ':' ||
  coalesce((SELECT md5(string_agg(r.status || '|' || r.revision || '|' || r.last_event || '|' ||
     coalesce((SELECT string_agg(e.events::text, '#' ORDER BY e.seq) FROM turn_events e
               WHERE e.turn_id = r.id AND e.seq < r.last_event), ''), '#' ORDER BY r.revision))
   FROM turn_runs r WHERE r.conversation_id = c.id), '-') AS digest
FROM conversations c WHERE c.id = ANY($1::uuid[])
"""


async def _compare_rows(
    url: str, measured: dict[tuple[str, str], Measured]
) -> dict[tuple[str, str], tuple[int, int]]:
    """For each kind and subject: its conversations whose rows are turnstore's, of all."""
    digests: dict[tuple[str, str], list[dict[int, str | None]]] = {}
    conn = await asyncpg.connect(libpq_url(url))
    try:
        for key, m in measured.items():
            ids = [uuid.UUID(cid.removeprefix("conv_")) for run in m.conversations
                   for cid in run.values()]  # fmt: skip
            found = {row["id"]: row["digest"] for row in await conn.fetch(_DIGEST, ids)}
            digests[key] = [
                {n: found.get(uuid.UUID(cid.removeprefix("conv_"))) for n, cid in run.items()}
                for run in m.conversations
            ]
    finally:
        await conn.close()
    same: dict[tuple[str, str], tuple[int, int]] = {}
    for (kind, subject), runs in digests.items():
        reference = digests[(kind, "turnstore")][0]
        values = [(value, reference.get(n)) for run in runs for n, value in run.items()]
        same[(kind, subject)] = (sum(a is not None and a == b for a, b in values), len(values))
    return same


@contextmanager
def realtime(pid: int) -> Iterator[bool]:
    """The server's thread under SCHED_FIFO while inside (if this process may: root or
    CAP_SYS_NICE): it runs whenever it is runnable, never waiting for a core. On this busy
    machine a server otherwise waits about twice as long for a core as it runs (schedstat),
    and a sampling profiler counts that waiting as busy, most of it right after the socket
    writes that woke the client or PostgreSQL: the profile would not be one of CPU time."""
    try:
        os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))


def _sampler_first() -> None:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(2))


@dataclass(frozen=True)
class Profile:
    path: Path
    subject: str
    kind: str
    cpu_ms: float  # the server's CPU per turn while it was sampled
    fifo: bool  # it ran under SCHED_FIFO (the samples are of CPU time)


PROFILE_LOADS, PROFILE_RATE = 3, 250


def profile(subject: str, pid: int, port: int, kind: str, raw: Path, out: Path) -> Profile:
    """A py-spy record of the server under PROFILE_LOADS more loads of ``kind`` (not
    measured) into ``raw``, and the flame graph of its event loop's thread into ``out``."""
    spy = Path(sys.executable).parent / "py-spy"
    command = [str(spy), "record", "--pid", str(pid), "--rate", str(PROFILE_RATE), "--function",
               "--threads", "--format", "raw", "--output", str(raw)]  # fmt: skip
    turns = 0
    with realtime(pid) as fifo:
        recorder = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Above the server: a sampler that waits for a core samples late, and it would
            # wait when the client and PostgreSQL run, which the server's own work wakes.
            preexec_fn=_sampler_first if fifo else None,
        )
        try:
            time.sleep(1.0)  # attached
            cpu = process_cpu_s(pid)
            for _ in range(PROFILE_LOADS):
                starts = asyncio.run(load.prepare(kind, port, CONVERSATIONS))
                turns += asyncio.run(load.run(kind, port, starts, TURNS, CONCURRENCY)).turns
            cpu = process_cpu_s(pid) - cpu
        finally:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)
    roots, samples = flame.from_raw(raw)
    how = "under SCHED_FIFO" if fifo else "as scheduled (waits for a core count as busy)"
    title = (
        f"{subject}, {kind} turns: its event loop's thread, {samples:,} samples at "
        f"{PROFILE_RATE} Hz over {turns:,} turns, {how}"
    )
    flame.write_svg(roots, samples, out, title)
    return Profile(out, subject, kind, cpu / turns * 1000, fifo)


FILE_NAMES = {"/api/v1": "plain", "stream": "stream", "/v1": "v1"}


def run(
    url: str, logs: Path, rounds: int, *, realtime_servers: bool = False,
    flames: Path | None = None,
) -> FloorsResult:  # fmt: skip
    """``rounds`` rounds of every kind for every subject; with ``flames``, a flame graph of
    each subject under each kind written there afterwards."""
    measured = {(kind, s): Measured() for kind in load.KINDS for s in SUBJECTS}
    servers: dict[str, tuple[int, int]] = {}  # subject -> (pid, port)
    profiles: list[Profile] = []
    with ExitStack() as stack:
        for subject in SUBJECTS:
            port = free_port()
            env = {"DATABASE_URL": sqlalchemy_url(url), "LLM_PROVIDER": "fake"}
            log = logs / f"floors-{subject}.log"
            pid = stack.enter_context(running(_command(subject, port), port, env, log))
            servers[subject] = (pid, port)

        async def rounds_of() -> None:
            for r in range(rounds):
                order = SUBJECTS[r % 3 :] + SUBJECTS[: r % 3]
                for kind in load.KINDS:
                    for subject in order:
                        pid, port = servers[subject]
                        with realtime(pid) if realtime_servers else nullcontext(False):
                            await _measure(kind, port, pid, url, measured[(kind, subject)])

        asyncio.run(rounds_of())
        rows = asyncio.run(_compare_rows(url, measured))
        if flames is not None:
            flames.mkdir(parents=True, exist_ok=True)
            for kind in load.KINDS:
                for subject in SUBJECTS:
                    pid, port = servers[subject]
                    name = f"{subject}-{FILE_NAMES[kind]}"
                    out, raw = flames / f"{name}.svg", logs / f"{name}.raw"
                    profiles.append(profile(subject, pid, port, kind, raw, out))
    return FloorsResult(rounds, measured, rows, realtime_servers, profiles)


def lines(result: FloorsResult) -> Iterator[str]:
    yield (
        f"{'turn':8} {'subject':10} {'server CPU ms/turn':>18}  {'turns/s':>14}  "
        f"{'DB CPU':>7} {'stmts':>6}  rows as turnstore's"
    )
    yield (
        f"{'':8} {'':10} {'min':>8} {'median':>9}  {'best':>6} {'median':>7}  "
        f"{'us/turn':>7} {'/turn':>6}"
    )
    for kind in load.KINDS:
        for subject in SUBJECTS:
            m = result.measured[(kind, subject)]
            low, mid = m.cpu
            best, median_tps = max(m.turns_per_s), statistics.median(m.turns_per_s)
            db = statistics.median(m.db_cpu_us)
            statements = sum(m.per_turn().values())
            same, total = result.rows[(kind, subject)]
            rows = "(the reference)" if subject == "turnstore" else f"{same} of {total} same"
            yield (
                f"{kind:8} {subject:10} {low:8.2f} {mid:9.2f}  {best:6.0f} {median_tps:7.0f}  "
                f"{db:7.0f} {statements:6.2f}  {rows}"
            )
    where = "under SCHED_FIFO (never waiting for a core)" if result.realtime else "as scheduled"
    yield (
        f"  ({result.rounds} rounds of {CONVERSATIONS} x {TURNS} turns at concurrency "
        f"{CONCURRENCY} per kind and subject, servers {where}; DB CPU and turns/s: medians;"
        " rows: conversations whose rows and runs are byte for byte turnstore's)"
    )
    yield "  server CPU ms/turn of each round:"
    for kind in load.KINDS:
        rounds = (
            f"{s} " + "/".join(f"{x:.2f}" for x in result.measured[(kind, s)].cpu_ms)
            for s in SUBJECTS
        )
        yield f"    {kind:8} " + "; ".join(rounds)
    yield "  statements per turn (pg_stat_statements, all rounds):"
    for kind in load.KINDS:
        per = {s: result.measured[(kind, s)].per_turn() for s in SUBJECTS}
        names = {
            name
            for p in per.values()
            for name in p
            if max(q.get(name, 0) for q in per.values()) >= 0.005
        }
        yield f"    {kind:50} " + " ".join(f"{s:>9}" for s in SUBJECTS)
        for name in sorted(names, key=lambda n: -per["turnstore"].get(n, 0)):
            values = " ".join(f"{per[s].get(name, 0):9.2f}" for s in SUBJECTS)
            yield f"      {name[:48]:48} {values}"
    for p in result.profiles:
        how = "SCHED_FIFO" if p.fifo else "as scheduled: waits for a core counted as busy"
        yield (
            f"  flame graph {p.path} ({how}; the sampler stops the server {PROFILE_RATE} times a "
            "second: "
            f"{p.cpu_ms:.2f} ms of CPU per turn meanwhile)"
        )


V1_OVER_API = 1.2


def ratios(result: FloorsResult) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(kind, floor) -> turnstore's server CPU per turn over the floor's: of the rounds'
    minimums, of their medians; and the target."""
    found = {}
    for kind in load.KINDS:
        ours = result.measured[(kind, "turnstore")].cpu
        for floor, target in TARGETS.items():
            theirs = result.measured[(kind, floor)].cpu
            found[(kind, floor)] = (ours[0] / theirs[0], ours[1] / theirs[1], target)
    # A /v1 turn against an /api/v1 turn, both turnstore's (issue 20: at most 1.2x).
    v1, api = (result.measured[(kind, "turnstore")].cpu for kind in ("/v1", "/api/v1"))
    found[("/v1", "/api/v1")] = (v1[0] / api[0], v1[1] / api[1], V1_OVER_API)
    return found
