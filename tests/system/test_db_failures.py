"""Each kind of database failure that is not a query error (issue 28), provoked on a private
server (tests/support/pgserver.py): a refused login (pg_hba.conf ``reject``, 28000), too many clients
(every connection slot taken, 53300), a server starting up (a standby that may not serve
reads stays in recovery: 57P03), a server shutting down (a smart shutdown waits for the
sessions open and refuses new ones: 57P03), and a connection lost at checkout (the server
ending sessions as they are made). In each, the sessions open before have ended, so a pool
must connect anew.

What must hold: the store's one way to the database raises StorageError with the server's
SQLSTATE; every HTTP surface answers ``500 storage_error`` (the API key lookup included) and
``/readyz`` ``503 not_ready``, never ``internal_error``; a turn cut off by the failure ends in
``storage_error``, a stream with exactly one terminal event; and once the server is back, the
next turn on that conversation succeeds at once, on the replica that ran it (its in-process
lock was let go) and on another (its lease was given back). The same holds when what fails
is no database failure at all, but something nobody foresaw while a turn gives its lease back
or logs its end (seams over the real store).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app, postgres_backend
from service.core.errors import StorageError
from service.core.model import RunEnd
from service.platform import migrate
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.store.ports import Backend
from service.store.postgres import ApiKeyStore, PostgresStore, StoreConfig
from service.store.postgres.listener import PostgresNotifications
from service.store.postgres.places import PostgresPlaces
from service.store.postgres.run_homes import KnownRuns
from service.store.postgres.run_store import PostgresRunWrites
from service.store.postgres.tx import driver
from tests.support.cluster import TURNSTORE, free_port, process, turnstore_env, wait_until
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import (
    CHAT,
    TURN_KINDS,
    assert_error,
    error_code,
    serve,
    turn_outcome,
    until_renewed,
)
from tests.support.pgserver import PrivatePostgres, private_postgres, until_refused

REFUSALS = {  # kind -> the SQLSTATE of a new connection's refusal
    "login refused": "28000",
    "too many clients": "53300",
    "starting up": "57P03",
    "shutting down": "57P03",
}
QUEUE_WAIT_S = 5.0  # a turn that found its conversation held would get 409 after this
AT_ONCE_S = 3.0  # "at once": well within that (a lease given back is heard of, or polled)
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[PrivatePostgres]:
    # No connection slots kept for superusers: the tests connect as one, and fill them all.
    # Connections logged: a test waits for the listener's.
    settings = "-c max_connections=40 -c superuser_reserved_connections=0 -c log_connections=on"
    with private_postgres(settings) as server:
        migrate.upgrade(server.url)
        yield server


# --- making the server refuse ---------------------------------------------------------------


async def _close_others(admin: asyncpg.Connection, keep: Sequence[asyncpg.Connection] = ()) -> int:
    """Every other client session but ``keep`` ends (a pool must connect anew), and is gone;
    how many there were."""
    query = (
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'"
        " AND pid <> pg_backend_pid() AND pid <> ALL($1::int[])"
    )
    pids = [row["pid"] for row in await admin.fetch(query, [c.get_server_pid() for c in keep])]
    await admin.execute("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) pid", pids)

    async def gone() -> bool:
        left = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])"
        return int(await admin.fetchval(left, pids)) == 0

    await wait_until(gone, "the sessions to end", TIMEOUT_S)
    return len(pids)


async def _fill(server: PrivatePostgres) -> list[asyncpg.Connection]:
    """Sessions in every free connection slot, until the server refuses one (53300)."""
    held: list[asyncpg.Connection] = []
    while True:
        try:
            held.append(await asyncpg.connect(server.dsn, timeout=5))
        except asyncpg.TooManyConnectionsError:
            return held


@asynccontextmanager
async def refusing(server: PrivatePostgres, kind: str) -> AsyncIterator[None]:
    """While inside, the server refuses every new connection as ``kind`` says, and the
    sessions open before have ended; afterwards it accepts them again."""
    if kind == "starting up":
        await asyncio.to_thread(server.stop, "fast")
        await asyncio.to_thread(server.start_standby, hot=False)
        try:
            await until_refused(server, REFUSALS[kind])
            yield
        finally:
            await asyncio.to_thread(server.stop, "fast")
            await asyncio.to_thread(server.start)
        return
    admin = await asyncpg.connect(server.dsn)
    held: list[asyncpg.Connection] = []
    hba: str | None = None
    try:
        if kind == "login refused":
            hba = server.hba("host all all 127.0.0.1/32 reject\n")
            await admin.execute("SELECT pg_reload_conf()")
            await until_refused(server, REFUSALS[kind])
            while await _close_others(admin):  # one let in just before: it ends too
                pass
        elif kind == "too many clients":
            # Full first; then the others' slots taken as they end (a replica may connect
            # meanwhile: its session ends too, until none but these are left).
            held = await _fill(server)
            while await _close_others(admin, keep=held):
                held += await _fill(server)
        else:
            assert kind == "shutting down", kind
            await asyncio.to_thread(server.stop, "smart", wait=False)
            await until_refused(server, REFUSALS[kind])
            while await _close_others(admin):  # one let in just before: it ends too
                pass
        yield
    finally:
        for conn in held:
            await conn.close()
        if hba is not None:
            server.hba(hba)
            await admin.execute("SELECT pg_reload_conf()")
        if kind == "shutting down":  # stopped now (with this session: the last one), and up
            await asyncio.to_thread(server.stop, "fast")
            await asyncio.to_thread(server.start)
        admin.terminate()
    await until_refused(server, None)


# --- the store ------------------------------------------------------------------------------


async def _ping(engine: AsyncEngine) -> None:
    async with driver(engine, write=False) as conn:
        await conn.fetchval("SELECT 1")


@pytest.mark.parametrize("kind", list(REFUSALS))
async def test_the_store_raises_storage_error_with_the_servers_sqlstate(
    server: PrivatePostgres, kind: str
) -> None:
    engine = create_engine(server.url, pool_size=2)
    try:
        await _ping(engine)  # a pooled connection, idle: the server closes it
        async with refusing(server, kind):
            for _ in range(2):  # a first one may fail on the closed connection
                with pytest.raises(StorageError) as failed:
                    await _ping(engine)
            assert failed.value.sqlstate == REFUSALS[kind]
        await _ping(engine)  # and the pool serves again
    finally:
        await engine.dispose()


async def test_a_connection_lost_at_checkout_is_storage_error(server: PrivatePostgres) -> None:
    """The server ends the pool's sessions as soon as they are made: a statement finds its
    connection closed before it starts, while it runs, or the pool finds every new one closed
    at checkout (and gives up), or the session ends while the connection is set up."""
    engine = create_engine(server.url, pool_size=2)
    admin = await asyncpg.connect(server.dsn)
    stop = asyncio.Event()

    async def kill() -> None:
        while not stop.is_set():
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'turnstore'"
            )
            await asyncio.sleep(0)

    killing = asyncio.create_task(kill())
    failures: list[BaseException] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(failures) < 200 and time.monotonic() < deadline:
            try:
                await _ping(engine)
            except Exception as exc:  # what it is, is the point
                failures.append(exc)
    finally:
        stop.set()
        await killing
        await admin.close()
        await engine.dispose()
    assert len(failures) >= 200
    others = {type(exc).__name__ for exc in failures if not isinstance(exc, StorageError)}
    assert not others, others


# --- over HTTP ------------------------------------------------------------------------------


@asynccontextmanager
async def _apps(
    server: PrivatePostgres, api: FakeResponsesAPI, count: int = 1, **settings: Any
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """``count`` apps on the server's database, each with its own pool (replicas)."""
    async with _served(_config(server, **settings), api, count) as clients:
        yield clients


def _config(server: PrivatePostgres, **settings: Any) -> Settings:
    return Settings(
        database_url=server.url, turn_queue_wait_s=QUEUE_WAIT_S, owner_max_running_turns=1000,
        **settings,
    )  # fmt: skip


@asynccontextmanager
async def _served(
    config: Settings, api: FakeResponsesAPI, count: int
) -> AsyncIterator[list[httpx.AsyncClient]]:
    if count == 0:
        yield []
        return
    app = create_app(config, provider=api.provider())
    async with (
        serve(app) as url,
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client,
        _served(config, api, count - 1) as others,
    ):
        yield [client, *others]


async def _new(client: httpx.AsyncClient) -> str:
    response = await client.post(CHAT, json={"message": "first"})
    assert response.status_code == 200, response.text
    return str(response.json()["conversation_id"])


async def _next_turns_at_once(clients: list[httpx.AsyncClient], cid: str, revision: int) -> None:
    """The next turn of ``cid`` on each of ``clients`` in turn succeeds at once, the first at
    ``revision``."""
    for client in clients:
        asked = time.monotonic()
        response = await client.post(CHAT, json={"message": "next", "conversation_id": cid})
        took = time.monotonic() - asked
        assert response.status_code == 200, response.text
        assert response.json()["revision"] == revision
        assert took < AT_ONCE_S, took
        revision += 1


@pytest.mark.parametrize("kind", list(REFUSALS))
async def test_every_surface_answers_storage_error_and_readyz_503(
    server: PrivatePostgres, kind: str
) -> None:
    api = FakeResponsesAPI()
    engine = create_engine(server.url, pool_size=1)
    try:
        key = await ApiKeyStore(engine).create("alice")
    finally:
        await engine.dispose()
    bearer = {"Authorization": f"Bearer {key}"}
    async with (
        _apps(server, api) as (plain,),
        _apps(server, api, auth_mode="api_key") as (keyed,),
    ):
        cid = await _new(plain)
        assert (await keyed.get("/api/v1/conversations", headers=bearer)).status_code == 200
        async with refusing(server, kind):
            for turn_kind in TURN_KINDS:
                refused = await turn_outcome(plain, cid, turn_kind, "refused")
                assert refused == (500, "storage_error"), turn_kind
            assert_error(await plain.post(CHAT, json={"message": "new"}), 500, "storage_error")
            assert_error(await plain.get(f"/api/v1/conversations/{cid}"), 500, "storage_error")
            assert_error(await plain.get("/readyz"), 503, "not_ready")
            # The API key is looked up on every request: that lookup fails the same way.
            listed = await keyed.get("/api/v1/conversations", headers=bearer)
            assert_error(listed, 500, "storage_error")
            v1 = await keyed.post("/v1/responses", json={"input": "x"}, headers=bearer)
            assert (v1.status_code, error_code(v1)) == (500, "storage_error")
        for turn_kind in TURN_KINDS:
            assert await turn_outcome(plain, cid, turn_kind, "back") == (200, "ok")
        assert (await keyed.get("/api/v1/conversations", headers=bearer)).status_code == 200
        assert (await plain.get("/readyz")).status_code == 200


@pytest.mark.parametrize("kind", list(REFUSALS))
async def test_a_turn_cut_off_ends_in_storage_error_and_its_conversation_is_free_at_once(
    server: PrivatePostgres, kind: str
) -> None:
    """A plain, a streamed and a /v1 streamed turn, each held in the provider with its lease
    taken when the database starts refusing; then the provider answers."""
    api = FakeResponsesAPI()
    kinds = TURN_KINDS
    async with _apps(server, api, count=2) as (here, elsewhere):
        cids = [await _new(here) for _ in kinds]
        gate = asyncio.Event()
        scripts = [Script(gate=gate) for _ in kinds]
        api.then(*scripts)
        running = []
        for cid, turn_kind, script in zip(cids, kinds, scripts, strict=True):
            running.append(asyncio.create_task(turn_outcome(here, cid, turn_kind, "cut off")))
            await asyncio.wait_for(script.started.wait(), TIMEOUT_S)
        async with refusing(server, kind):
            gate.set()
            cut = await asyncio.wait_for(asyncio.gather(*running), TIMEOUT_S)
        assert cut == [(500, "storage_error"), (200, "storage_error"), (200, "storage_error")]
        # The next turn of each conversation: here (the in-process lock was let go), then
        # on another replica (the lease was given back); each at once, on top of the first
        # (the turn cut off left nothing).
        for cid in cids:
            await _next_turns_at_once([here, elsewhere], cid, 2)


@pytest.mark.parametrize("kind", list(REFUSALS))
async def test_renewals_go_on_after_a_refusal(server: PrivatePostgres, kind: str) -> None:
    """A streamed turn held in the provider while the database refuses for longer than a
    renewal interval (``TURN_LEASE_S / 3``), with nothing else going on: once the database is
    back, its lease and its run's heartbeat are renewed again (the loops that renew them
    survived their failures), and the turn commits."""
    lease_s = 1.5
    api = FakeResponsesAPI()
    async with _apps(server, api, turn_lease_s=lease_s) as (client,):
        cid = await _new(client)
        gate = asyncio.Event()
        script = Script(gate=gate)
        api.then(script)
        held = asyncio.create_task(turn_outcome(client, cid, "stream", "held"))
        await asyncio.wait_for(script.started.wait(), TIMEOUT_S)
        async with refusing(server, kind):
            await asyncio.sleep(1.5 * lease_s / 3)  # the scenario: a renewal meets the refusal
        await until_renewed(server.dsn, cid, time.monotonic(), lease_s)
        gate.set()
        assert await asyncio.wait_for(held, TIMEOUT_S) == (200, "ok")


# --- whatever the exception ---------------------------------------------------------------


class _GiveBackFails(PostgresPlaces):
    """A seam: the first time each, giving a turn's lease back and giving its place among its
    owner's running turns back raise what nobody foresaw (not a database failure)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed: set[str] = set()

    async def release_lease(self, conversation_id: uuid.UUID, holder: uuid.UUID) -> None:
        if "lease" not in self.failed:
            self.failed.add("lease")
            raise RuntimeError("unforeseen")
        await super().release_lease(conversation_id, holder)

    async def free_turn(self, owner: str, holder: uuid.UUID) -> None:
        if "place" not in self.failed:
            self.failed.add("place")
            raise RuntimeError("unforeseen")
        await super().free_turn(owner, holder)


class _EndFails(PostgresRunWrites):
    """A seam: while ``broken``, logging a run's end raises what nobody foresaw."""

    broken = True

    async def end_run(self, run_id: uuid.UUID, owner: str, end: RunEnd) -> bool:
        if self.broken:
            raise RuntimeError("unforeseen")
        return await super().end_run(run_id, owner, end)


@asynccontextmanager
async def _seamed(
    server: PrivatePostgres, api: FakeResponsesAPI, backend: Backend
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """An app over ``backend`` (here), and an ordinary one beside it (elsewhere)."""
    app = create_app(_config(server), provider=api.provider(), backend=backend)
    async with (
        serve(app) as url,
        httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as here,
        _apps(server, api) as (elsewhere,),
    ):
        yield here, elsewhere


async def test_a_failure_while_giving_the_lease_back_leaves_the_conversation_free(
    server: PrivatePostgres,
) -> None:
    api = FakeResponsesAPI()
    store = PostgresStore.over(create_engine(server.url, pool_size=4))
    failing = _GiveBackFails(store.db)
    backend = postgres_backend(_config(server), store=replace(store, places=failing))
    async with _seamed(server, api, backend) as (here, elsewhere):
        cid = await _new(here)
        api.then(Script(http_status=500))  # the turn does not commit: it gives its lease back
        failed = await here.post(CHAT, json={"message": "fails", "conversation_id": cid})
        assert_error(failed, 502, "upstream_error")  # its own failure, not the giving back's
        assert failing.failed == {"lease", "place"}
        # Here (the in-process lock was let go), then elsewhere (the lease was given back).
        await _next_turns_at_once([here, elsewhere], cid, 2)


async def test_a_stream_whose_end_cannot_be_logged_still_ends_with_one_terminal_event(
    server: PrivatePostgres,
) -> None:
    api = FakeResponsesAPI()
    config = _config(server)
    engine = create_engine(server.url, pool_size=4)
    store = PostgresStore.over(engine, StoreConfig(events_ttl_s=config.turn_events_ttl_s))
    runs = _EndFails(store.db, KnownRuns(store.db))
    backend = postgres_backend(config, store=replace(store, run_writes=runs))
    async with _seamed(server, api, backend) as (here, elsewhere):
        cids = [await _new(here) for _ in range(2)]
        api.then(Script(http_status=500), Script(http_status=500))
        for cid, kind in zip(cids, ("stream", "v1"), strict=True):
            assert await turn_outcome(here, cid, kind, "fails") == (200, "upstream_error")
        runs.broken = False
        for cid in cids:
            await _next_turns_at_once([here, elsewhere], cid, 2)


# --- the listener ---------------------------------------------------------------------------


async def test_the_listener_connects_again_after_the_database_was_read_only(
    server: PrivatePostgres,
) -> None:
    """Notifications come back after a failover's window in which the only server is a
    standby: meanwhile the listener's connections, which ask for a writable server
    (``target_session_attrs=read-write``), are refused as asyncpg refuses them
    (TargetServerAttributeNotMatched, an InternalClientError)."""
    url = f"{server.url}?target_session_attrs=read-write"
    engine = create_engine(url, pool_size=1)
    listener = PostgresNotifications(url, engine)
    try:
        async with listener.subscribe("anything"):

            async def healthy() -> bool:
                return listener.healthy

            await wait_until(healthy, "notifications to arrive", TIMEOUT_S)
            await asyncio.to_thread(server.stop, "fast")
            logged = server.log.stat().st_size
            await asyncio.to_thread(server.start_standby, hot=True)

            async def refused() -> bool:
                """The listener tried the standby (log_connections) and was refused."""
                log = server.log.read_bytes()[logged:]
                return b"application_name=turnstore-listen" in log

            await wait_until(refused, "the listener to try the standby", TIMEOUT_S)
            assert not listener.healthy
            await asyncio.to_thread(server.promote)
            await wait_until(healthy, "notifications to arrive again", TIMEOUT_S)
    finally:
        await listener.close()
        await engine.dispose()


# --- the commands ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["login refused", "no server"])
async def test_db_commands_say_the_database_failed_in_one_line(
    server: PrivatePostgres, kind: str, tmp_path: Path
) -> None:
    """`turnstore db current`, `upgrade` and `downgrade` against a database that refuses the
    login, or where no server listens: exit status 1 and one line naming the cause."""
    url, refused = server.url, refusing(server, kind)
    if kind == "no server":
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/postgres"
        refused = contextlib.nullcontext()
    async with refused:
        for command in (["current"], ["upgrade"], ["downgrade", "0005"]):
            log = tmp_path / f"{command[0]}.log"
            with process([TURNSTORE, "db", *command], log, turnstore_env(DATABASE_URL=url)) as ran:
                status = await ran.wait(60)
            output = log.read_text()
            assert status == 1 and "Traceback" not in output, output
            line = output.strip().splitlines()[-1]
            assert line.startswith("turnstore db: the database failed: "), output
            assert ("28000" if kind == "login refused" else "ConnectionRefusedError") in line
