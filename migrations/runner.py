"""How migrations run on a live database (migrations/env.py uses this; deploy/README.md,
"Migrations", says it for operators).

- Every migration runs in its own transaction, and every lock wait of the runner's session
  is bounded by ``lock_timeout`` (MIGRATION_LOCK_TIMEOUT_S). A statement that would queue
  for longer (behind a long read of ``turns``, say) fails with SQLSTATE 55P03 instead, so
  the turns queued behind it wait at most that long. The migration is then rolled back as a
  whole and run again after a backoff, a bounded number of times; the migrations before it
  stay committed. A deadlock (40P01) is retried the same way.
- Concurrent runners serialise on a session-level advisory lock. It is taken with
  ``pg_try_advisory_lock`` and polled, so a runner waiting for another one never sits in a
  lock queue. It is released when the runner ends (and by the server when its session ends).
- A killed runner leaves nothing behind: ``client_connection_check_interval`` (PostgreSQL
  14 and later) makes its backend notice the closed connection within a second even while
  it waits for a lock or runs a statement, and roll back; ``lock_timeout`` bounds any wait in
  any case.
- The runner's connections carry ``application_name=turnstore-migrate``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

LOCK_ID = 0x7475726E  # "turn": the advisory lock every runner (and `db distribute`) takes
APPLICATION_NAME = "turnstore-migrate"
ATTEMPTS = 12  # per migration; with the backoff below about three minutes in all
RETRIED = {"55P03": "a lock wait ran out", "40P01": "a deadlock"}
CHECK_INTERVAL = "1s"  # client_connection_check_interval

log = logging.getLogger("turnstore.migrate")
T = TypeVar("T")


class GaveUp(RuntimeError):
    """A migration could not take its locks in ``attempts`` tries: the schema stays where the
    migrations before it left it (each committed on its own)."""


def server_settings(lock_timeout_s: float) -> dict[str, str]:
    """Session settings sent when the runner connects."""
    return {
        "application_name": APPLICATION_NAME,
        "lock_timeout": f"{max(1, round(lock_timeout_s * 1000))}ms",
    }


def prepare_session(connection: Connection) -> None:
    """What can only be set once connected (it depends on the server's version)."""
    if int(connection.scalar(text("SHOW server_version_num")) or 0) >= 140000:
        connection.execute(text(f"SET client_connection_check_interval = '{CHECK_INTERVAL}'"))
    connection.commit()


def backoff_s(attempt: int) -> float:
    """Before attempt ``attempt + 1``: 0.5, 1, 2, 4, 8, 16, then 30 s, each with jitter (so
    concurrent runners and the service's own retries do not meet again in step)."""
    return float(min(0.5 * 2 ** (attempt - 1), 30.0) * random.uniform(0.5, 1.0))


def take_lock(connection: Connection, poll_s: float = 0.5) -> None:
    """The runners' advisory lock, polled without ever queueing for it."""
    said = False
    while not connection.scalar(text("SELECT pg_try_advisory_lock(:id)"), {"id": LOCK_ID}):
        if not said:
            holder = connection.execute(
                text(
                    "SELECT a.pid, a.application_name, a.client_addr::text"
                    " FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                    " WHERE l.locktype = 'advisory' AND l.granted AND l.objid = :id"
                    " AND l.database = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                ),
                {"id": LOCK_ID},
            ).first()
            who = f"pid {holder.pid} ({holder.application_name or '?'})" if holder else "another"
            log.info("waiting for %s: another migration runs", who)
            said = True
        connection.commit()
        time.sleep(poll_s * random.uniform(0.8, 1.2))
    connection.commit()


def release_lock(connection: Connection) -> None:
    """At the end of a run, also a failed one; a connection that broke meanwhile lost the lock
    with its session, and its error is the one worth reporting."""
    try:
        if connection.in_transaction():
            connection.rollback()
        connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": LOCK_ID})
        connection.commit()
    except DBAPIError as exc:
        log.warning("could not release the advisory lock (%s): its session ended", sqlstate(exc))


def sqlstate(exc: BaseException) -> str | None:
    state = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return str(state) if state else None


def run_with_retries(
    connection: Connection,
    run: Callable[[], None],
    heads: Callable[[], Sequence[str]],
    attempts: int = ATTEMPTS,
    lock_timeout_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """``run`` (Alembic's run_migrations) again from the migration that failed for a lock (or
    a deadlock), ``attempts`` times at most per migration. ``heads``: the committed revision
    (read under the same rule, see ``retried``)."""
    tries = _Attempts(attempts, lock_timeout_s, sleep)
    failed: object = None
    while True:
        try:
            run()
            return
        except DBAPIError as exc:
            state = _rolled_back(connection, exc)
            at = ", ".join(retried(connection, heads, attempts, lock_timeout_s, sleep)) or "base"
            connection.commit()
            if at != failed:  # a new migration fails: count afresh
                failed, tries = at, _Attempts(attempts, lock_timeout_s, sleep)
            tries.back_off(exc, state, at)


def retried(
    connection: Connection,
    read: Callable[[], T],
    attempts: int = ATTEMPTS,
    lock_timeout_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``read()``, one of the runner's own reads (the version table's revisions, before and
    between the migrations), under a migration's rule: its lock waits are bounded by the lock
    timeout too, so a session that holds the table locked longer ends it with 55P03; it is then
    rolled back and run again after the same backoff, ``attempts`` times at most."""
    tries = _Attempts(attempts, lock_timeout_s, sleep)
    while True:
        try:
            return read()
        except DBAPIError as exc:
            tries.back_off(exc, _rolled_back(connection, exc), None)


def _rolled_back(connection: Connection, exc: DBAPIError) -> str:
    """The SQLSTATE of a failure worth another attempt, its transaction rolled back; any other
    failure raised as it is."""
    state = sqlstate(exc)
    if state not in RETRIED:
        raise exc
    if connection.in_transaction():
        connection.rollback()
    return state


class _Attempts:
    """The failed attempts at one step (a migration, or a read of the revision)."""

    def __init__(self, attempts: int, lock_timeout_s: float, sleep: Callable[[float], None]):
        self.attempts, self.lock_timeout_s, self.sleep = attempts, lock_timeout_s, sleep
        self.failures, self.since = 0, time.monotonic()

    def back_off(self, exc: DBAPIError, state: str, at: str | None) -> None:
        """One more failed: wait before the next attempt, or give up (GaveUp, one line) after
        the last. ``at``: the revision the schema stays at (None: the attempt was to read it)."""
        self.failures += 1
        statement = " ".join(str(exc.statement or "?").split())[:120]
        if self.failures >= self.attempts:
            stays = f"stays at {at}" if at is not None else "stays where it was"
            raise GaveUp(
                f"gave up after {self.attempts} attempts in {time.monotonic() - self.since:.0f} "
                f"s, the last ended by {RETRIED[state]} (lock_timeout {self.lock_timeout_s:g} s) "
                f"in `{statement}`: a session holds a lock it needs (look in pg_locks and "
                f"pg_stat_activity). The schema {stays} (each migration commits on its own); "
                "run it again later."
            ) from None
        pause = backoff_s(self.failures)
        log.warning(
            "%s: attempt %d of %d ended by %s (sqlstate %s) in `%s`; rolled back, again in %.1f s",
            f"from revision {at}" if at is not None else "reading the revision", self.failures,
            self.attempts, RETRIED[state], state, statement, pause,
        )  # fmt: skip
        self.sleep(pause)
