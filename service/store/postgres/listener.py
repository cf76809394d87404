"""Notifications between replicas through PostgreSQL: LISTEN on a connection of its own.

One connection per process, never a pooled one: behind PgBouncer in transaction mode a pooled
connection's server session changes hands between transactions, so a LISTEN there would hear
nothing (or someone else's). Point ``DATABASE_LISTEN_URL`` at the server itself (or at a
session-mode pool) in that case; ``pg_notify()``, which the committing transaction sends, works
through any pooling. Whether notifications arrive is checked with a ping sent the way real
notifications are (a ``pg_notify()`` through the service's own pool) when the listener
connects and then every ``PING_EVERY_S``; while they do not arrive, ``healthy`` is False and
waiters look again by themselves, sooner. After a reconnect every subscriber is woken:
anything may have been missed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import StorageError
from service.platform.db import driver_connect_args
from service.store.postgres.statements import CHANNEL
from service.store.postgres.tx import FAILURES, driver, sql
from service.store.subscribers import Subscribers

PING_EVERY_S = 30.0
PING_WAIT_S = 2.0
RECONNECT_S = (0.1, 5.0)  # first and longest wait before connecting again

log = logging.getLogger("turnstore.notifications")
_PING = sql("SELECT pg_notify(:channel, :payload)")


class PostgresNotifications:
    def __init__(self, url: str, engine: AsyncEngine) -> None:
        self._connect_args = driver_connect_args(url)
        self._engine = engine  # the pool, to ping through
        self._subscribers = Subscribers()
        self._healthy = False
        self._pong = asyncio.Event()
        self._ping = ""
        self._checked = False
        self._task: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @asynccontextmanager
    async def subscribe(self, topic: str) -> AsyncIterator[asyncio.Event]:
        self.start()
        async with self._subscribers.subscribe(topic) as inbox:
            yield inbox

    def _deliver(self, topic: str) -> None:
        if topic == self._ping:
            self._pong.set()
        self._subscribers.notify(topic)

    async def _listen(self) -> None:
        """Listen, and connect again whenever the connection fails, for as long as the process
        runs: a database failure of any kind (tx.FAILURES) is waited out quietly, anything
        else is logged, and neither ends the loop (without it, waiters only poll)."""
        backoff = RECONNECT_S[0]
        while True:
            try:
                conn = await asyncpg.connect(**self._connect_args)
            except Exception as exc:
                _unforeseen(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_S[1])
                continue
            lost = _lost(conn)
            try:
                await conn.add_listener(CHANNEL, self._on_notify)
                while not lost.is_set():
                    await self._check()
                    backoff = RECONNECT_S[0]
                    # After (re)connecting: anything may have been missed.
                    self._subscribers.wake_all()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(PING_EVERY_S):
                            await lost.wait()
            except Exception as exc:
                if _unforeseen(exc):  # not in a busy loop, should it fail at once again
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_S[1])
            finally:
                self._healthy = False
                conn.terminate()  # at once: this also runs when the task is cancelled

    async def _check(self) -> None:
        """A notification sent through the pool, as commits send theirs: does it arrive?"""
        self._ping, was = f"ping:{uuid.uuid4()}", self._healthy
        self._pong.clear()
        try:
            async with driver(self._engine, write=False) as conn:
                await _PING.execute(conn, {"channel": CHANNEL, "payload": self._ping})
        except StorageError:
            self._healthy = False  # no database: no notifications either
            return
        try:
            async with asyncio.timeout(PING_WAIT_S):
                await self._pong.wait()
            self._healthy = True
        except TimeoutError:
            self._healthy = False
            if was or not self._checked:
                log.warning(
                    "notifications do not arrive (PgBouncer in transaction mode? set "
                    "DATABASE_LISTEN_URL): waiters look again by themselves"
                )
        self._checked = True

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        self._deliver(payload)


def _unforeseen(exc: Exception) -> bool:
    """Whether ``exc`` is not a database failure (it is logged then)."""
    if isinstance(exc, FAILURES):
        return False
    log.error("the notification listener failed; it connects again", exc_info=exc)
    return True


def _lost(conn: asyncpg.Connection) -> asyncio.Event:
    """An event set when ``conn`` goes away."""
    lost = asyncio.Event()
    conn.add_termination_listener(lambda _: lost.set())
    return lost
