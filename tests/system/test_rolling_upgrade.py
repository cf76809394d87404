"""A rolling upgrade as an operator runs it, with the previous release (deploy/PREVIOUS_RELEASE,
tests/support/previous_release.py) as real processes.

The database is built by the previous release's own `turnstore db upgrade`. A replica of the
previous release serves a turn every half second while a read transaction holds ``turns``
(ACCESS SHARE), and this release's `turnstore db upgrade` runs: no turn waits longer than
MIGRATION_LOCK_TIMEOUT_S plus a little, none fails, nothing deadlocks, and the upgrade
finishes once the reader ends. Run twice: to this release's head (nothing to do while the
release brings no migration), and to a scratch migration on top of it that needs ACCESS
EXCLUSIVE on ``turns`` (tests/support/scratch.py), which is what makes the lock handling visible.

Then the migrate Job with a mismatched image: the previous release's `db current` and
`db upgrade` on a schema a newer release wrote.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from service.platform import migrate
from tests.support.cluster import TURNSTORE, process, turnstore_env, wait_ready
from tests.support.database import asyncpg_dsn, fresh_database
from tests.support.previous_release import Release
from tests.support.scratch import REVISION, scratch_migration

LOCK_TIMEOUT_S = 2.0  # MIGRATION_LOCK_TIMEOUT_S's default
A_LITTLE_S = 1.5  # a turn's own time on a loaded machine
READER_S = 8.0  # longer than the lock timeout several times over
TICK_S = 0.5


@pytest.fixture
def previous_schema(server_url: str, previous_release: Release) -> Iterator[str]:
    """A database at the previous release's head, made by its own `turnstore db upgrade`."""
    with fresh_database(server_url) as url:
        done = previous_release.run("db", "upgrade", DATABASE_URL=url)
        assert done.returncode == 0, done.stderr
        yield url


@dataclass
class Turns:
    """A turn every TICK_S against ``base``: alternately a new conversation and the next turn
    of one conversation. Each turn's start, how long it took, and its status."""

    base: str
    seen: list[tuple[float, float, int]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        conversation = None
        async with httpx.AsyncClient(base_url=self.base, timeout=60) as client:
            number = 0
            while not self.stop.is_set():
                number += 1
                body: dict[str, object] = {"message": f"turn {number}"}
                if number % 2 == 0 and conversation:
                    body["conversation_id"] = conversation
                started = time.monotonic()
                answer = await client.post("/api/v1/chat", json=body)
                took = time.monotonic() - started
                self.seen.append((started, took, answer.status_code))
                if answer.status_code == 200 and conversation is None:
                    conversation = answer.json()["conversation_id"]
                await asyncio.sleep(max(0.0, TICK_S - took))


async def _deadlocks(url: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return int(
            await conn.fetchval(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            )
        )
    finally:
        await conn.close()


def _upgrade_command(url: str, scratch: str | None) -> list[str]:
    if scratch is None:
        return [TURNSTORE, "db", "upgrade"]
    # This release's runner, with the scratch migration beside the release's own.
    code = (
        "import logging, sys; from service.platform import migrate; logging.basicConfig(level='INFO'); "
        "migrate.upgrade(sys.argv[1], version_locations=[sys.argv[2]])"
    )
    return [sys.executable, "-c", code, url, scratch]


@pytest.mark.parametrize("to", ["head", "head+scratch"])
async def test_upgrade_while_the_previous_release_serves_and_a_reader_holds_turns(
    previous_schema: str, previous_release: Release, tmp_path: Path, to: str
) -> None:
    url = previous_schema
    scratch = scratch_migration(tmp_path / "versions") if to == "head+scratch" else None
    expected = REVISION if scratch else migrate.head_revision()
    deadlocks = await _deadlocks(url)
    with previous_release.serve(tmp_path / "previous.log", DATABASE_URL=url) as old:
        await wait_ready(old)
        turns = Turns(old.url)
        driving = asyncio.create_task(turns.run())
        reader = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await asyncio.sleep(2 * TICK_S)  # a few turns before anything happens
            await reader.execute("BEGIN; SELECT count(*) FROM turns")  # ACCESS SHARE, held
            held = time.monotonic()
            env = turnstore_env(DATABASE_URL=url, LOG_FORMAT="text")
            with process(_upgrade_command(url, scratch), tmp_path / "upgrade.log", env) as up:
                while time.monotonic() - held < READER_S:
                    assert up.popen.poll() is None or scratch is None, up.tail()
                    await asyncio.sleep(0.1)
                await reader.execute("COMMIT")
                ended = time.monotonic()
                status = await up.wait(60)
                finished_after = time.monotonic() - ended
            await asyncio.sleep(4 * TICK_S)  # and a few turns after it
        finally:
            turns.stop.set()
            await driving
            await reader.close()
        async with httpx.AsyncClient(base_url=old.url) as client:
            ready = await client.get("/readyz")  # the old replica still serves on the new schema
    log = up.log.read_text()
    assert status == 0, log
    assert ready.status_code == 200, ready.text
    statuses = [code for _, _, code in turns.seen]
    assert statuses and set(statuses) == {200}, statuses
    longest = max(took for _, took, _ in turns.seen)
    assert longest < LOCK_TIMEOUT_S + A_LITTLE_S, (longest, log)
    assert await _deadlocks(url) == deadlocks
    assert "deadlock" not in log
    assert finished_after < 10, finished_after
    versions = await _versions(url)
    assert versions == [expected]
    if scratch:
        # The migration met the reader: it waited, rolled back and came back, and turns ran
        # in between (some during the reader's hold).
        assert "attempt 1 of" in log and "55P03" in log, log
        during = [s for s, took, _ in turns.seen if held < s < ended]
        assert len(during) >= READER_S / (LOCK_TIMEOUT_S + A_LITTLE_S), turns.seen


async def _versions(url: str) -> list[str]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return [r[0] for r in await conn.fetch("SELECT version_num FROM alembic_version")]
    finally:
        await conn.close()


async def test_the_previous_releases_tools_on_a_newer_schema(
    previous_schema: str, previous_release: Release
) -> None:
    """The migrate Job run with the previous image after this release migrated: its `db
    upgrade` fails quickly without touching the schema, naming the revision it does not
    know. (deploy/README.md, "A mismatched image", says what each command does.)"""
    url = previous_schema
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute("UPDATE alembic_version SET version_num = '0999'")
    finally:
        await conn.close()
    started = time.monotonic()
    upgrade = await asyncio.to_thread(previous_release.run, "db", "upgrade", DATABASE_URL=url)
    assert upgrade.returncode != 0 and time.monotonic() - started < 30
    assert "0999" in upgrade.stderr
    assert await _versions(url) == ["0999"]
    current = await asyncio.to_thread(previous_release.run, "db", "current", DATABASE_URL=url)
    # 58b2f86: Alembic's "Can't locate revision identified by '0999'" and a traceback, so
    # the Job's wait for the database never ends before its deadline. Releases from this
    # one on name it and exit 0 (tests/integration/test_migration_runner.py).
    assert "0999" in current.stdout + current.stderr
    if current.returncode == 0:
        assert "unknown to this release" in current.stdout
