"""The migration runner on a live database (migrations/runner.py): a migration that needs a
lock a reader holds waits at most the lock timeout, rolls back, backs off and runs again, and
the statements queued behind it wait no longer than that; it gives up after bounded attempts
with one line; concurrent runners wait without queueing; a killed runner leaves nothing
behind; CREATE INDEX CONCURRENTLY runs outside the migration's transaction and survives an
interrupted attempt; a revision of a newer release is refused in one line.

The migrations are scratch ones on top of this release's head (tests/support/scratch.py), so this
holds whether or not the release brings a migration of its own."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import asyncpg
import pytest
from alembic import command

from migrations import runner
from service.platform import migrate
from tests.support.cluster import TURNSTORE, process, turnstore_env, wait_until
from tests.support.database import asyncpg_dsn
from tests.support.scratch import REVISION, scratch_migration

LOCK_TIMEOUT_S = 0.5
SLACK_S = 0.5  # scheduling, a round trip


async def _connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url))


async def _version(url: str) -> str:
    conn = await _connect(url)
    try:
        return str(await conn.fetchval("SELECT version_num FROM alembic_version"))
    finally:
        await conn.close()


class Prober:
    """Reads ``turns`` as a turn would, one after another, recording how long each waited."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.waits: list[float] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        conn = await _connect(self.url)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                await conn.fetchval("SELECT count(*) FROM (SELECT 1 FROM turns LIMIT 1) t")
                self.waits.append(time.monotonic() - started)
                await asyncio.sleep(0.05)
        finally:
            await conn.close()

    def stop(self) -> None:
        self._stop.set()


async def _runner_sessions(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(
        await conn.fetch(
            "SELECT pid, state, wait_event_type FROM pg_stat_activity"
            " WHERE application_name = $1 AND datname = current_database()",
            runner.APPLICATION_NAME,
        )
    )


async def test_a_held_lock_is_waited_for_briefly_retried_and_then_taken(
    database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    locations = [scratch_migration(tmp_path / "versions")]
    reader = await _connect(database)
    observer = await _connect(database)
    prober = Prober(database)
    probing = asyncio.create_task(prober.run())
    try:
        await reader.execute("BEGIN; SELECT count(*) FROM turns")  # ACCESS SHARE, held
        upgrade = asyncio.create_task(
            asyncio.to_thread(
                migrate.upgrade,
                database,
                lock_timeout_s=LOCK_TIMEOUT_S,
                version_locations=locations,
            )
        )
        # The runner shows itself by name, and its retries show in the log.
        await wait_until(
            lambda: _has(observer), "the runner's session (application_name)", timeout_s=30
        )
        await wait_until(lambda: _logged(caplog, "attempt 2 of"), "a second attempt", timeout_s=30)
        assert not upgrade.done()
        await reader.execute("COMMIT")
        released = time.monotonic()
        await asyncio.wait_for(upgrade, timeout=30)
        finished = time.monotonic() - released
    finally:
        prober.stop()
        await probing
        await reader.close()
        await observer.close()
    assert await _version(database) == REVISION
    # The reads queued behind the waiting ALTER waited at most about the lock timeout.
    assert prober.waits and max(prober.waits) < LOCK_TIMEOUT_S + SLACK_S, max(prober.waits)
    # The backoff is short at first: the migration goes through soon after the reader ends.
    assert finished < 5, finished
    retried = [r.getMessage() for r in caplog.records if "attempt" in r.getMessage()]
    assert "ALTER TABLE turns ADD COLUMN scratch" in retried[0] and "55P03" in retried[0]


async def _has(conn: asyncpg.Connection) -> bool:
    return bool(await _runner_sessions(conn))


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


def test_gives_up_after_bounded_attempts_with_one_clear_line(database: str, tmp_path: Path) -> None:
    async def hold() -> asyncpg.Connection:
        reader = await _connect(database)
        await reader.execute("BEGIN; SELECT count(*) FROM turns")
        return reader

    loop = asyncio.new_event_loop()
    reader = loop.run_until_complete(hold())
    try:
        config = migrate.alembic_config(
            database,
            lock_timeout_s=0.2,
            version_locations=[scratch_migration(tmp_path / "versions")],
        )
        config.attributes["attempts"] = 2
        started = time.monotonic()
        with pytest.raises(runner.GaveUp) as failure:
            command.upgrade(config, "head")
        took = time.monotonic() - started
    finally:
        loop.run_until_complete(reader.close())
        loop.close()
    message = str(failure.value)
    assert "\n" not in message
    assert "gave up after 2 attempts" in message and "ALTER TABLE turns" in message
    assert f"stays at {migrate.head_revision()}" in message
    assert took < 5, took
    assert asyncio.run(_version(database)) == migrate.head_revision()


def _runner(database: str, locations: str, lock_timeout_s: float, log: Path):  # type: ignore[no-untyped-def]
    """`migrate.upgrade` with the scratch migrations, as a process of its own (Alembic's
    context is one per process)."""
    code = (
        "import logging, sys; from service.platform import migrate; logging.basicConfig(level='INFO'); "
        "migrate.upgrade(sys.argv[1], "
        "lock_timeout_s=float(sys.argv[3]), version_locations=[sys.argv[2]])"
    )
    args = [sys.executable, "-c", code, database, locations, str(lock_timeout_s)]
    return process(args, log, turnstore_env())


async def test_a_killed_runner_leaves_nothing_queued(database: str, tmp_path: Path) -> None:
    """Killed while it waits for a lock, with a lock timeout far longer than the test: only
    client_connection_check_interval can end its backend this soon."""
    locations = scratch_migration(tmp_path / "versions")
    reader = await _connect(database)
    observer = await _connect(database)
    try:
        await reader.execute("BEGIN; SELECT count(*) FROM turns")
        with _runner(database, locations, 60, tmp_path / "runner.log") as proc:

            async def queued() -> bool:
                rows = await observer.fetch(
                    "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                    " WHERE a.application_name = $1 AND NOT l.granted",
                    runner.APPLICATION_NAME,
                )
                return bool(rows)

            await wait_until(queued, "the runner to queue for the lock on turns")
            proc.signal(signal.SIGKILL)
            killed = time.monotonic()
            await wait_until(
                lambda: _gone(observer), "the killed runner's backend to go", timeout_s=10
            )
            gone_after = time.monotonic() - killed
        # Nothing queued any more: a read of turns (as a turn does) goes through at once.
        started = time.monotonic()
        await observer.fetchval("SELECT count(*) FROM turns")
        assert time.monotonic() - started < 0.5
    finally:
        await reader.close()
        await observer.close()
    assert gone_after < 3, gone_after
    assert await _version(database) == migrate.head_revision()


async def _gone(conn: asyncpg.Connection) -> bool:
    return not await _runner_sessions(conn)


async def test_concurrent_runners_wait_for_each_other_without_queueing(
    database: str, tmp_path: Path
) -> None:
    """While one runner waits for a lock on turns, a second one polls the advisory lock: it
    sits in no lock queue, and goes on (finding the work done) once the first is through."""
    locations = scratch_migration(tmp_path / "versions")
    reader = await _connect(database)
    observer = await _connect(database)
    try:
        await reader.execute("BEGIN; SELECT count(*) FROM turns")
        with _runner(database, locations, 0.3, tmp_path / "first.log") as first:
            await wait_until(lambda: _count_sessions(observer, 1), "the first runner")
            with _runner(database, locations, 0.3, tmp_path / "second.log") as second:
                await wait_until(
                    lambda: _count_sessions(observer, 2), "the second runner", timeout_s=30
                )
                await asyncio.sleep(1)  # the second one polls meanwhile: observed below
                waiting = await observer.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                assert waiting == 0
                assert first.popen.poll() is None and second.popen.poll() is None
                await reader.execute("COMMIT")
                statuses = [await first.wait(60), await second.wait(60)]
        assert statuses == [0, 0], (first.tail(), second.tail())
    finally:
        await reader.close()
        await observer.close()
    assert await _version(database) == REVISION
    ran = [p for p in (first, second) if "Running upgrade" in p.log.read_text()]
    assert ran == [first]
    assert "waiting for pid" in second.log.read_text()  # who it waits for


async def _count_sessions(conn: asyncpg.Connection, n: int) -> bool:
    return len(await _runner_sessions(conn)) >= n


CONCURRENT_INDEX = """\
live.create_index_concurrently(op, "turns_scratch_created", "turns", "created_at")
op.execute("ALTER TABLE conversations ADD COLUMN scratch text")
"""


async def test_an_index_built_concurrently_survives_an_interrupted_attempt(
    database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CREATE INDEX CONCURRENTLY waits for transactions older than it; behind a long one it
    runs out of lock time and leaves an invalid index. The retry drops and rebuilds it."""
    locations = [scratch_migration(tmp_path / "versions", CONCURRENT_INDEX)]
    old = await _connect(database)
    observer = await _connect(database)
    try:
        await old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM turns")
        upgrade = asyncio.create_task(
            asyncio.to_thread(
                migrate.upgrade,
                database,
                lock_timeout_s=LOCK_TIMEOUT_S,
                version_locations=locations,
            )
        )
        await wait_until(lambda: _logged(caplog, "attempt 1 of"), "a failed attempt")
        assert not upgrade.done()
        await old.execute("COMMIT")
        await asyncio.wait_for(upgrade, timeout=30)
        valid = await observer.fetchval(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = 'turns_scratch_created'"
        )
    finally:
        await old.close()
        await observer.close()
    assert valid is True
    assert await _version(database) == REVISION
    retried = next(r.getMessage() for r in caplog.records if "attempt 1 of" in r.getMessage())
    assert "CREATE INDEX CONCURRENTLY" in retried


async def test_a_newer_releases_revision_is_refused_in_one_line(
    database: str, tmp_path: Path
) -> None:
    conn = await _connect(database)
    try:
        await conn.execute("UPDATE alembic_version SET version_num = '0999'")
    finally:
        await conn.close()
    env = turnstore_env(DATABASE_URL=database)
    with process([TURNSTORE, "db", "current"], tmp_path / "current.log", env) as current:
        assert await current.wait(30) == 0, current.tail()
    assert "data schema: 0999 (unknown to this release" in current.tail()
    started = time.monotonic()
    with process([TURNSTORE, "db", "upgrade"], tmp_path / "upgrade.log", env) as upgrade:
        status = await upgrade.wait(30)
    took = time.monotonic() - started
    lines = upgrade.log.read_text().strip().splitlines()
    assert status == 1 and took < 15, (status, took)
    assert "Traceback" not in upgrade.log.read_text()
    assert lines[-1].startswith("turnstore db: the database's alembic_version is at 0999")
    assert "newer release" in lines[-1]
    with process(
        [TURNSTORE, "db", "downgrade", "0005"], tmp_path / "downgrade.log", env
    ) as downgrade:
        assert await downgrade.wait(30) == 1
    assert "does not know" in downgrade.tail(1) and "Traceback" not in downgrade.tail()


@pytest.mark.parametrize("table", ["alembic_version", "keyring_version"])
async def test_a_lock_on_the_version_table_is_waited_out_like_any_other(
    database: str, tmp_path: Path, table: str
) -> None:
    """Issue 28: `turnstore db upgrade` reads the version table (is it a newer release's
    revision?) before it migrates. Behind a session that holds that table locked for longer
    than the lock timeout, that read too backs off and tries again, as every migration does:
    the upgrade succeeds once the lock is gone, without a traceback."""
    holder = await _connect(database)
    observer = await _connect(database)
    env = turnstore_env(DATABASE_URL=database, MIGRATION_LOCK_TIMEOUT_S=str(LOCK_TIMEOUT_S))
    try:
        await holder.execute(f"BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        locked = time.monotonic()
        with process([TURNSTORE, "db", "upgrade"], tmp_path / "upgrade.log", env) as upgrade:

            async def retried() -> bool:
                """The runner's lock waits ran out twice at least, and it waits again."""
                assert upgrade.popen.poll() is None, upgrade.tail()
                return upgrade.log.read_text().count("lock wait ran out") >= 2 and bool(
                    await observer.fetch(
                        "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                        " WHERE a.application_name = $1 AND NOT l.granted",
                        runner.APPLICATION_NAME,
                    )
                )

            await wait_until(retried, f"the runner to wait for {table} again", timeout_s=30)
            # The case: a lock held for 4 s, eight times the lock timeout.
            await asyncio.sleep(max(0.0, 4 - (time.monotonic() - locked)))
            await holder.execute("COMMIT")
            status = await upgrade.wait(30)
    finally:
        await holder.close()
        await observer.close()
    output = upgrade.log.read_text()
    assert status == 0, output
    assert "Traceback" not in output, output
    assert await _version(database) == migrate.head_revision()
