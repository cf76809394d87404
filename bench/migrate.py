"""Part 8, migrations: `turnstore db upgrade` from the previous release (deploy/PREVIOUS_RELEASE)
to this release's head, on 200,000 conversations.

The previous release is checked out and installed as the tests do it
(tests/support/previous_release.py, cached under .turnstore/releases/). A database is built at
its schema by its own `turnstore db upgrade` and filled by SQL: per conversation two turns of a
small workload and a completed Idempotency-Key record (only columns every release since 0011
has; a later release's migrations must cope with such rows anyway). Then this release's
`turnstore db upgrade` runs as a process while a sampler reads ``pg_locks`` every few
milliseconds for the runner's sessions (``application_name = turnstore-migrate``): per
migration, how long it ran (from the runner's log) and the longest time it held a lock on a
table, the longest of the modes that stop a turn (SHARE and stronger: a turn writes with ROW
EXCLUSIVE) and of any mode, and its longest wait in a lock queue. Locks shorter than the
sampling interval may be missed.

While this release brings no migration, it says "nothing to upgrade" and builds nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

from bench.database import admin, libpq_url, sqlalchemy_url
from migrations import runner
from service.platform import migrate
from tests.support.previous_release import prepare, previous_commit

CONVERSATIONS = 200_000
BATCH = 20_000
SAMPLE_S = 0.005
# What a turn's ROW EXCLUSIVE conflicts with: a migration holding one of these stops turns.
STOPS_TURNS = {"ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock"}


@dataclass
class Held:
    relation: str
    mode: str
    seconds: float


@dataclass
class Step:
    revision: str
    seconds: float = 0.0
    stops_turns: Held | None = None
    any_mode: Held | None = None
    waited_s: float = 0.0


@dataclass
class Result:
    previous: str
    previous_head: str
    head: str
    conversations: int = 0
    fill_s: float = 0.0
    upgrade_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    samples: int = 0


@contextmanager
def _database(server_url: str) -> Iterator[str]:
    name = f"turnstore_bench_migrate_{uuid.uuid4().hex[:8]}"
    asyncio.run(admin(server_url, f'CREATE DATABASE "{name}"'))
    try:
        yield libpq_url(_with_database(server_url, name))
    finally:
        asyncio.run(admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


_FILL = [
    """INSERT INTO conversations (id, revision, created_at, updated_at)
       SELECT md5('c' || i)::uuid, 2, now() - interval '1 day', now()
         FROM generate_series($1::int, $2::int) i""",
    """INSERT INTO turns (conversation_id, seq, user_message, assistant_message, replay_items,
                          created_at)
       SELECT md5('c' || i)::uuid, s, repeat('u', 200), repeat('a', 600),
              json_build_array(json_build_object('type', 'message', 'role', 'assistant',
                  'content', json_build_array(json_build_object('type', 'output_text',
                  'text', repeat('a', 600))))),
              now()
         FROM generate_series($1::int, $2::int) i, generate_series(1, 2) s""",
    """INSERT INTO idempotency_keys (owner, key, request_hash, state, expires_at,
                                     conversation_id, revision)
       SELECT 'anonymous', 'k' || i, md5('r' || i), 'done', now() + interval '1 day',
              md5('c' || i)::uuid, 2
         FROM generate_series($1::int, $2::int) i""",
]


async def _fill(url: str, conversations: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        for start in range(1, conversations + 1, BATCH):
            end = min(start + BATCH - 1, conversations)
            async with conn.transaction():
                for statement in _FILL:
                    await conn.execute(statement, start, end)
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()


_LOCKS = """
SELECT l.pid, coalesce(c.relname, l.relation::text) AS relation, l.mode, l.granted,
       (SELECT string_agg(version_num, ',') FROM alembic_version) AS at
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
  LEFT JOIN pg_class c ON c.oid = l.relation
 WHERE a.application_name = $1 AND a.datname = current_database()
   AND l.locktype = 'relation' AND l.relation >= 16384
   AND coalesce(c.relkind, 'r') IN ('r', 'p')  -- tables (indexes follow their table)
"""


@dataclass
class Sampler:
    """Intervals during which each (running migration, pid, relation, mode, granted) was seen
    in consecutive samples; the longest per migration."""

    url: str
    following: dict[str | None, str]  # committed revision -> the migration that runs next
    open: dict[tuple[str, int, str, str, bool], float] = field(default_factory=dict)
    longest: dict[tuple[str, str, str, bool], float] = field(default_factory=dict)
    samples: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        conn = await asyncpg.connect(self.url)
        last = time.monotonic()
        try:
            while not self.stop.is_set():
                rows = await conn.fetch(_LOCKS, runner.APPLICATION_NAME)
                now = time.monotonic()
                self.samples += 1
                seen = set()
                for row in rows:
                    at = row["at"]
                    step = self.following.get(at)
                    if step is None:
                        continue
                    key = (step, row["pid"], row["relation"], row["mode"], row["granted"])
                    seen.add(key)
                    self.open.setdefault(key, last)  # it began after the previous sample
                for key in list(self.open):
                    if key not in seen:
                        self._close(key, now)
                last = now
                await asyncio.sleep(SAMPLE_S)
            for key in list(self.open):
                self._close(key, time.monotonic())
        finally:
            await conn.close()

    def _close(self, key: tuple[str, int, str, str, bool], now: float) -> None:
        step, _, relation, mode, granted = key
        seconds = now - self.open.pop(key)
        short = (step, relation, mode, granted)
        self.longest[short] = max(self.longest.get(short, 0.0), seconds)


def _upgrade_args(url: str, scratch: Sequence[str]) -> list[str]:
    if not scratch:
        return [str(Path(sys.executable).with_name("turnstore")), "db", "upgrade"]
    code = (
        "import sys; from service.platform import migrate; "
        "from service.platform.logs import configure; "
        "configure(); migrate.upgrade(sys.argv[1], version_locations=sys.argv[2:])"
    )
    return [sys.executable, "-c", code, sqlalchemy_url(url), *scratch]


def _durations(log: str, finished: float) -> dict[str, float]:
    """From the runner's JSON log lines: each "Running upgrade A -> B" until the next one
    (or ``finished``, epoch seconds); a migration retried counts from its first start."""
    marks: list[tuple[str, float]] = []
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        message = str(entry.get("message", ""))
        if message.startswith("Running upgrade") and "->" in message:
            revision = message.split("->", 1)[1].split(",", 1)[0].strip()
            marks.append((revision, datetime.fromisoformat(entry["ts"]).timestamp()))
    ends = [at for _, at in marks[1:]] + [finished]
    durations: dict[str, float] = {}
    for (revision, began), end in zip(marks, ends, strict=True):
        durations[revision] = durations.get(revision, 0.0) + max(0.0, end - began)
    return durations


async def _measure(
    url: str, logs: Path, conversations: int, scratch: Sequence[str], result: Result
) -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config(version_locations=scratch))
    chain = list(reversed(list(script.walk_revisions())))
    following: dict[str | None, str] = {}
    started_at = result.previous_head
    for rev in chain:
        following[rev.down_revision] = rev.revision  # type: ignore[index]
    result.steps = []
    rev_at: str | None = started_at
    while rev_at in following:
        result.steps.append(Step(following[rev_at]))
        rev_at = following[rev_at]

    began = time.monotonic()
    await _fill(url, conversations)
    result.fill_s = time.monotonic() - began
    result.conversations = conversations

    sampler = Sampler(url, following)
    sampling = asyncio.create_task(sampler.run())
    log = logs / "migrate-upgrade.log"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env |= {"DATABASE_URL": sqlalchemy_url(url), "LOG_FORMAT": "json", "LOG_LEVEL": "info"}
    args = _upgrade_args(url, scratch)
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await proc.communicate()
    result.upgrade_s, finished = time.monotonic() - began, time.time()
    sampler.stop.set()
    await sampling
    result.samples = sampler.samples
    await asyncio.to_thread(log.write_bytes, output)
    text = output.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"db upgrade failed ({proc.returncode}): see {log}\n{text[-2000:]}")
    durations = _durations(text, finished)
    for step in result.steps:
        step.seconds = durations.get(step.revision, 0.0)
        for (name, relation, mode, granted), seconds in sampler.longest.items():
            if name != step.revision:
                continue
            if not granted:
                step.waited_s = max(step.waited_s, seconds)
                continue
            held = Held(relation, mode, seconds)
            if step.any_mode is None or seconds > step.any_mode.seconds:
                step.any_mode = held
            if mode in STOPS_TURNS and (
                step.stops_turns is None or seconds > step.stops_turns.seconds
            ):
                step.stops_turns = held


def run(
    server_url: str,
    logs: Path,
    conversations: int = CONVERSATIONS,
    version_locations: Sequence[str] = (),
) -> Result:
    """``version_locations``: migrations beside this release's (to try the part while the
    release brings none, e.g. tests/support/scratch.py's)."""
    release = prepare(previous_commit())
    result = Result(release.short, release.head(), migrate.head_revision() or "")
    if result.previous_head == result.head and not version_locations:
        return result
    with _database(server_url) as url:
        built = release.run("db", "upgrade", DATABASE_URL=sqlalchemy_url(url))
        if built.returncode != 0:
            raise RuntimeError(f"the previous release's db upgrade failed: {built.stderr}")
        asyncio.run(_measure(url, logs, conversations, version_locations, result))
    return result


def _held(held: Held | None) -> str:
    if held is None:
        return "-"
    mode = held.mode.removesuffix("Lock")
    return f"{mode} on {held.relation} {held.seconds * 1000:.0f} ms"


def lines(result: Result) -> Iterator[str]:
    if not result.steps:
        yield (
            f"nothing to upgrade: the previous release {result.previous} is at "
            f"{result.previous_head}, and so is this release's head"
        )
        return
    yield (
        f"from {result.previous} ({result.previous_head}) to {result.steps[-1].revision}: "
        f"{result.conversations:,} conversations, {2 * result.conversations:,} turns and "
        f"{result.conversations:,} Idempotency-Key records (filled in {result.fill_s:.0f} s)"
    )
    yield (
        f"db upgrade took {result.upgrade_s:.1f} s ({result.samples} pg_locks samples, every "
        f"{SAMPLE_S * 1000:g} ms at most)"
    )
    yield (
        f"{'migration':<10} {'took':>8}  {'longest lock that stops turns':<42} "
        f"{'longest lock of any mode':<42} {'longest wait':>12}"
    )
    for step in result.steps:
        yield (
            f"{step.revision:<10} {step.seconds:>7.2f}s  {_held(step.stops_turns):<42} "
            f"{_held(step.any_mode):<42} {step.waited_s * 1000:>9.0f} ms"
        )
