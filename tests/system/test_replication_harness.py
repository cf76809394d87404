"""The failover harness (tests/support/replication.py) and what a SQLAlchemy + asyncpg client sees
across a failover: the facts the turnstore failover test builds on.

- SQLAlchemy passes the multi-host URL through unchanged: ``create_connect_args`` gives asyncpg
  ``host=[...]``, ``port=[...]`` and ``target_session_attrs='read-write'`` (the query string
  is copied into the connect kwargs), and asyncpg skips a host in recovery.
- A pooled connection whose server was SIGKILLed raises ``sqlalchemy.exc.DBAPIError`` with
  ``connection_invalidated`` set (the pool replaces it): ``asyncpg.ConnectionDoesNotExistError``
  underneath for a statement in flight (a COMMIT here); for an idle or in-transaction
  connection, once asyncpg has seen the socket close, ``asyncpg.InterfaceError`` ("connection
  is closed"), raised as its subclass ``sqlalchemy.exc.InterfaceError``. No bare OSError or
  ConnectionResetError was seen.
- A new connection while the primary is dead and the standby not yet promoted raises the bare
  ``ConnectionRefusedError`` of the first host (asyncpg re-raises the last OSError, not
  "no host matched", and SQLAlchemy does not wrap connect-time OSErrors), in milliseconds.
- A commit's outcome is unknown when the connection breaks during it: here it is on the
  promoted standby although the client got ``ConnectionDoesNotExistError``.
- Without its synchronous standby a commit waits forever; a client-side timeout cancels the
  wait, and the transaction then stays committed on the primary.
- A first host that accepts TCP but never answers uses up asyncpg's whole connect
  ``timeout``: the next host is tried only after a refusal.
- A backend that outlives its postmaster sends FATAL 57P01 before closing; a statement on
  that connection before asyncpg has read the close raises ``asyncpg.InternalClientError``
  (``sqlalchemy.exc.InternalError`` through SQLAlchemy), which is neither an
  ``InterfaceError`` nor a ``PostgresError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy import exc, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from service.platform.db import create_engine as service_engine
from tests.support.replication import Node, ReplicatedPostgres


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., AsyncEngine]]:
    """``engines(url, **options)``: engines that are disposed of after the test."""
    made: list[AsyncEngine] = []

    def make(url: str, **options: Any) -> AsyncEngine:
        made.append(create_async_engine(url, **options))
        return made[-1]

    yield make
    for engine in made:
        await engine.dispose()


async def fetchval(node: Node, query: str) -> Any:
    """One query on its own connection to ``node`` (an observer, not the client under test)."""
    conn = await asyncpg.connect(node.dsn, timeout=5)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def wait_until(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def backends_waiting(node: Node, wait_event: str) -> int:
    query = f"SELECT count(*) FROM pg_stat_activity WHERE wait_event = '{wait_event}'"
    return int(await fetchval(node, query))


def driver_error(error: exc.DBAPIError) -> BaseException | None:
    """The asyncpg exception under SQLAlchemy's (``orig`` is the dialect's DB-API adapter)."""
    return error.orig.__cause__ if error.orig is not None else None


async def server_port(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT inet_server_port()"))).scalar_one())


async def values(conn: AsyncConnection) -> list[int]:
    return list((await conn.execute(text("SELECT x FROM t ORDER BY x"))).scalars())


async def test_failover_through_sqlalchemy(
    pair: ReplicatedPostgres, engines: Callable[..., AsyncEngine]
) -> None:
    old, new = pair.primary, pair.standby
    assert new is not None
    # No pre-ping here, to see what a broken pooled connection raises.
    engine = engines(pair.url, pool_size=3, max_overflow=0)
    # The multi-host URL reaches asyncpg as it is.
    assert engine.dialect.create_connect_args(engine.url) == (
        [],
        {
            "user": "postgres",
            "database": "postgres",
            "host": ["127.0.0.1", "127.0.0.1"],
            "port": [old.port, new.port],
            "target_session_attrs": "read-write",
        },
    )
    async with engine.begin() as conn:
        assert await server_port(conn) == old.port
        await conn.execute(text("CREATE TABLE t (x int)"))
        await conn.execute(text("INSERT INTO t VALUES (1)"))
    # remote_apply: acknowledged means replayed on the standby, no waiting needed.
    assert await fetchval(new, "SELECT array_agg(x) FROM t") == [1]

    # What the nodes report; asyncpg reads in_hot_standby from the startup parameters (PG 14+).
    for node, read_only in ((old, False), (new, True)):
        conn = await asyncpg.connect(node.dsn)
        try:
            assert await conn.fetchval("SHOW transaction_read_only") == (
                "on" if read_only else "off"
            )
            assert await conn.fetchval("SELECT pg_is_in_recovery()") is read_only
            assert conn.get_settings().in_hot_standby == ("on" if read_only else "off")
        finally:
            await conn.close()
    # The standby listed first is skipped with target_session_attrs=read-write.
    standby_first = (
        f"postgresql+asyncpg://postgres@/postgres?host=127.0.0.1:{new.port}"
        f"&host=127.0.0.1:{old.port}&target_session_attrs=read-write"
    )
    async with engines(standby_first).connect() as conn:
        assert await server_port(conn) == old.port

    # Connections in four states when the primary dies: idle in the pool, inside a
    # transaction with an uncommitted row, committing, and idle in a pool made as turnstore
    # makes its own (service/db.py). The COMMIT is held by pausing replay on the standby: its record is
    # flushed there, not applied, so the primary (remote_apply) has not acknowledged it yet.
    turnstore_like = service_engine(pair.url, pool_size=1)
    async with turnstore_like.connect() as conn:
        await server_port(conn)  # leaves a connection to the old primary in its pool
    idle, in_transaction, committing = [await engine.connect() for _ in range(3)]
    await idle.execute(text("SELECT 1"))
    await in_transaction.begin()
    await in_transaction.execute(text("INSERT INTO t VALUES (2)"))
    pair.sql(new, "SELECT pg_wal_replay_pause()")
    await committing.begin()
    await committing.execute(text("INSERT INTO t VALUES (3)"))
    commit = asyncio.create_task(committing.commit())
    await wait_until(lambda: _waiting_for_sync_rep(old), "the COMMIT to wait for the standby")
    await asyncio.to_thread(pair.wait_received)  # the commit record is on the standby's disk

    started = time.monotonic()
    pair.kill_primary()
    print(f"kill_primary: {time.monotonic() - started:.3f} s")

    with pytest.raises(exc.DBAPIError) as in_flight:
        await commit
    assert in_flight.value.connection_invalidated
    assert isinstance(driver_error(in_flight.value), asyncpg.ConnectionDoesNotExistError)
    for conn in (idle, in_transaction):
        with pytest.raises(exc.DBAPIError) as broken:
            await conn.execute(text("SELECT 1"))
        assert broken.value.connection_invalidated
        # Which driver error depends on whether asyncpg has seen the socket close yet.
        cause = driver_error(broken.value)
        assert isinstance(cause, asyncpg.InterfaceError | asyncpg.ConnectionDoesNotExistError)
        print(f"broken pooled connection: {type(broken.value).__name__} <- {cause!r}")
    for conn in (idle, in_transaction, committing):
        await conn.close()

    # Dead primary, standby still in recovery: the first host's refusal, at once.
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        async with engine.connect():
            pass
    refused_after = time.monotonic() - started
    print(f"connect with the primary dead, before promotion: refused in {refused_after:.4f} s")
    assert refused_after < 1

    pair.sql(new, "SELECT pg_wal_replay_resume()")
    started = time.monotonic()
    await asyncio.to_thread(pair.promote_standby)
    print(f"promote_standby: {time.monotonic() - started:.3f} s")
    assert pair.primary is new

    # A new connection from the same engine reaches the promoted node and takes writes. Every
    # acknowledged commit is there, nothing uncommitted, and also the commit whose client got
    # an error: a commit cut off by the failover has an unknown outcome, not a failed one.
    async with engine.begin() as conn:
        assert await server_port(conn) == new.port
        assert await values(conn) == [1, 3]
        await conn.execute(text("INSERT INTO t VALUES (4)"))
    # turnstore's pool (service/db.py) never hands out the stale connection: no request fails.
    try:
        async with turnstore_like.begin() as conn:
            assert await server_port(conn) == new.port
            await conn.execute(text("INSERT INTO t VALUES (5)"))
    finally:
        await turnstore_like.dispose()
    assert await fetchval(new, "SELECT array_agg(x ORDER BY x) FROM t") == [1, 3, 4, 5]


async def _waiting_for_sync_rep(node: Node) -> bool:
    return await backends_waiting(node, "SyncRep") == 1


async def test_commit_without_its_standby_waits_until_cancelled_and_stays(
    pair: ReplicatedPostgres, engines: Callable[..., AsyncEngine]
) -> None:
    """No standby, no acknowledgement: PostgreSQL has no timeout for that wait. The
    client's timeout (asyncpg's command_timeout, as service/db.py sets) cancels it, and the
    cancel does not undo the commit: the client got an error, the row is on the primary."""
    assert pair.standby is not None
    engine = engines(pair.url, connect_args={"command_timeout": 1})
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (x int)"))
    pair.kill(pair.standby)

    async def commit() -> None:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t VALUES (1)"))

    started = time.monotonic()
    committing = asyncio.create_task(commit())
    await wait_until(lambda: _waiting_for_sync_rep(pair.primary), "the COMMIT to wait")
    # Committed locally, not yet visible: the transaction still counts as running.
    assert await fetchval(pair.primary, "SELECT count(*) FROM t") == 0
    with pytest.raises(TimeoutError):  # asyncpg's, not wrapped by SQLAlchemy
        await committing
    print(f"commit without standby: TimeoutError after {time.monotonic() - started:.2f} s")

    async def visible() -> bool:
        return bool(await fetchval(pair.primary, "SELECT count(*) FROM t") == 1)

    await wait_until(visible, "the cancelled wait to publish the commit")
    assert await backends_waiting(pair.primary, "SyncRep") == 0


async def test_a_hung_first_host_uses_up_the_whole_connect_timeout() -> None:
    """asyncpg moves to the next host only when a host refuses (OSError) or says it is
    starting up; ``timeout`` bounds the whole multi-host attempt, not each host. A first host
    that accepts TCP but never answers (a stopped postmaster, a peer behind a half-open
    network path) therefore fails the connect although the second host is healthy. A SIGKILLed
    node on loopback refuses at once, so the failover test does not hit this."""
    with socket.socket() as hung, socket.socket() as healthy:
        for sock in (hung, healthy):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        healthy.setblocking(False)
        (_, hung_port), (_, healthy_port) = hung.getsockname(), healthy.getsockname()
        url = (
            f"postgresql+asyncpg://postgres@/postgres?host=127.0.0.1:{hung_port}"
            f"&host=127.0.0.1:{healthy_port}&target_session_attrs=read-write"
        )
        engine = create_async_engine(url, connect_args={"timeout": 0.5})
        started = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                async with engine.connect():
                    pass
        finally:
            await engine.dispose()
        assert 0.5 <= time.monotonic() - started < 2
        with pytest.raises(BlockingIOError):
            healthy.accept()  # nobody ever tried the second host


class FinHoldingProxy:
    """A loopback TCP proxy to ``port`` that relays bytes both ways but holds back the
    server's end of each connection: what the server sent before closing reaches the client,
    the close itself only when the proxy stops. It makes "the client has read the server's
    last message but not yet its FIN" last as long as a test needs."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.server_closed = 0  # connections whose server end has closed (and been held)
        self._release = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, hold: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        if hold:
            self.server_closed += 1
            await self._release.wait()
        dst.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        for pump in (self._pump(reader, up_writer, False), self._pump(up_reader, writer, True)):
            self._tasks.add(asyncio.create_task(pump))

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        """Yields the proxy's port."""
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            self._release.set()
            server.close()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


async def test_a_backend_outliving_its_postmaster_leaves_asyncpg_in_an_internal_error_state(
    pair: ReplicatedPostgres, engines: Callable[..., AsyncEngine]
) -> None:
    """When the postmaster dies before its backends (an OOM kill; or, by a hair, the family
    SIGKILL of ``kill``, which hits the postmaster first), an idle backend sends its client
    FATAL 57P01 before it closes the socket. asyncpg, idle, does not expect a message: it
    moves its protocol to an error state and waits for a ReadyForQuery that never comes.
    Until it has read the FIN, the next statement on that connection raises
    ``asyncpg.InternalClientError`` ("cannot switch to state ...; another operation (2) is in
    progress"), neither an ``InterfaceError`` nor a ``PostgresError``, and asyncpg aborts the
    connection. Through SQLAlchemy it is ``sqlalchemy.exc.InternalError``, a disconnect (the
    connection is closed by then); on the driver connection underneath, as turnstore's hot
    path uses it, it is the bare asyncpg error. The proxy holds the FIN back to make the
    window last; without it, it is the few event loop turns between the two."""
    node = pair.primary
    proxy = FinHoldingProxy(node.port)
    async with proxy.serving() as port:
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
        engine = engines(url, pool_size=2, max_overflow=0)
        async with engine.connect() as core, engine.connect() as hot:
            await server_port(core)
            driver = (await hot.get_raw_connection()).driver_connection
            assert driver is not None
            await driver.fetchval("SELECT 1")
            await asyncio.to_thread(pair.kill_postmaster, node)
            await wait_until(
                _async(lambda: proxy.server_closed == 2), "the backends to close their sockets"
            )
            # The FATALs are in the clients' socket buffers: a few loop turns deliver them.
            for _ in range(5):
                await asyncio.sleep(0)

            with pytest.raises(asyncpg.InternalClientError, match=r"another operation \(2\)"):
                await driver.execute("BEGIN")
            assert driver.is_closed()
            with pytest.raises(exc.InternalError) as wrapped:
                await core.execute(text("SELECT 1"))
            assert wrapped.value.connection_invalidated
            assert isinstance(driver_error(wrapped.value), asyncpg.InternalClientError)
            print(f"backend outliving its postmaster: {driver_error(wrapped.value)!r}")
            await hot.invalidate()


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def checked() -> bool:
        return check()

    return checked
