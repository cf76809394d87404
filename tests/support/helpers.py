"""Small helpers shared by the API tests."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import jwt
import openai
import uvicorn
from httpx_sse import aconnect_sse
from litestar import Litestar
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app, postgres_backend
from service.core.errors import StorageError
from service.core.model import ANONYMOUS, Conversation
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from service.store.postgres import PostgresStore
from service.store.postgres.places import PostgresPlaces
from tests.support.backends import memory_backend, memory_store
from tests.support.memory import MemoryStore

CHAT = "/api/v1/chat"


async def start(client: httpx.AsyncClient) -> str:
    """A new conversation with one turn ("first"); its id."""
    response = await client.post(CHAT, json={"message": "first"})
    assert response.status_code == 200, response.text
    return str(response.json()["conversation_id"])


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The contract's envelope, with the same correlation id in body and header."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and isinstance(error["message"], str)
    assert error["correlation_id"] == response.headers["x-correlation-id"]
    assert "Traceback" not in response.text and "SELECT" not in response.text
    return dict(error)


async def snapshot(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    """Everything stored of conversations, to compare before and after a failed turn (not the
    turn lease's columns: who may run a turn now is no content of the conversation)."""
    columns = "id, revision, created_at, updated_at, context_start, owner"
    async with engine.connect() as conn:
        conversations = (
            await conn.execute(text(f"SELECT {columns} FROM conversations ORDER BY id"))
        ).all()
        turns = (
            await conn.execute(
                text(
                    "SELECT conversation_id, seq, user_message, assistant_message, "
                    "replay_items::text FROM turns ORDER BY conversation_id, seq"
                )
            )
        ).all()
    return [tuple(r) for r in conversations] + [tuple(r) for r in turns]


@asynccontextmanager
async def serve(app: Any, **config: Any) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a loopback port, in this test's event loop (so a
    test can pause a fake provider with an asyncio.Event), over real HTTP with real
    disconnects. ``config`` overrides uvicorn options."""
    sock = socket.socket()
    # Each answer at once (accepted sockets inherit it): without, a response written in two
    # parts waits for the client's delayed ACK, 40 ms a request on loopback.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    options: dict[str, Any] = {
        "lifespan": "on", "log_level": "warning", "timeout_graceful_shutdown": 5, **config,
    }  # fmt: skip
    server = _Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        server.stopping.set()
        await task
        sock.close()


class _Server(uvicorn.Server):
    """uvicorn's server, which stops as soon as it is told and its connections and tasks are
    done: uvicorn's own looks every 0.1 s and then sleeps 0.1 s more, two tenths of a second
    for each app a test serves. The steps of its shutdown are uvicorn 0.55's."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopping = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                # uvicorn's state has no event to wait on
                while self.server_state.connections or self.server_state.tasks:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()


class FailingRenewals(PostgresPlaces):
    """A seam for the tests: this replica's turn-lease renewals cannot reach the database."""

    async def renew_leases(self, leases: Sequence[tuple[UUID, UUID]], lease_s: float) -> set[UUID]:
        raise StorageError()


def failing_renewals(engine: AsyncEngine) -> PostgresStore:
    """The store over ``engine``, its lease renewals FailingRenewals'."""
    store = PostgresStore.over(engine)
    return replace(store, places=FailingRenewals(store.db))


@asynccontextmanager
async def stale_and_fresh(
    database_url: str, engine: AsyncEngine, api: Any, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Two replicas on the database calling ``api`` (a FakeResponsesAPI), a client of each:
    the first's turn-lease renewals cannot reach the database (FailingRenewals), the second's
    can."""
    config = Settings(database_url=database_url, **settings)
    store = failing_renewals(engine)
    stale = create_app(
        config, backend=postgres_backend(config, store=store), provider=api.provider()
    )
    fresh = create_app(config, provider=api.provider())
    async with (
        serve(stale) as stale_url,
        serve(fresh) as fresh_url,
        httpx.AsyncClient(base_url=stale_url, timeout=60, verify=TLS) as a,
        httpx.AsyncClient(base_url=fresh_url, timeout=60, verify=TLS) as b,
    ):
        yield a, b


async def until_lease_expired(engine: AsyncEngine, cid: str, timeout_s: float = 10) -> None:
    """Poll (with a deadline) until the conversation's turn lease has run out."""
    query = text("SELECT lease_expires_at <= now() FROM conversations WHERE id = :id")
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with engine.connect() as conn:
            if await conn.scalar(query, {"id": UUID(cid)}):
                return
        assert asyncio.get_running_loop().time() < deadline, "the lease never expired"
        await asyncio.sleep(0.05)


async def until_renewed(dsn: str, cid: str, since: float, lease_s: float) -> None:
    """Poll (with a deadline) until the conversation's turn lease and the heartbeat of the run
    that holds it were both renewed after ``since`` (time.monotonic()): each runs until more
    than ``lease_s`` after it."""
    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        ago = datetime.timedelta(seconds=time.monotonic() - since)
        then = await conn.fetchval("SELECT now()") - ago + datetime.timedelta(seconds=lease_s)
        query = (
            "SELECT least(c.lease_expires_at, r.heartbeat_until) FROM conversations c"
            " JOIN turn_runs r ON r.conversation_id = c.id AND r.finished_at IS NULL"
            " WHERE c.id = $1"
        )
        deadline = time.monotonic() + 30
        while (until := await conn.fetchval(query, UUID(cid))) is None or until <= then:
            assert time.monotonic() < deadline, "the lease and the heartbeat were not renewed"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


JWT_SECRET = "turnstore-tests-jwt-secret-" + "x" * 32
JWT_SETTINGS = {
    "auth_mode": "jwt",
    "jwt_secret": JWT_SECRET,
    "jwt_issuer": "t",
    "jwt_audience": "t",
}


def jwt_bearer(sub: str) -> dict[str, str]:
    """The Authorization header of a valid token for ``sub`` under JWT_SETTINGS."""
    claims = {"sub": sub, "iss": "t", "aud": "t", "exp": int(time.time()) + 600}
    return {"Authorization": f"Bearer {jwt.encode(claims, JWT_SECRET, algorithm='HS256')}"}


Wire = list[httpx.Request]

# One TLS context for every client of the tests (each new one would read the CA bundle again,
# some 15 ms a client); they speak plain HTTP on loopback anyway.
TLS = ssl.create_default_context()


@dataclass
class Target:
    """Where the apps a test builds keep their state: the database at ``database_url`` (each
    app with its own pool), or, without one, one in-memory store for the test (the unit layer:
    tests/support/memory.py) that every app of the test shares, as replicas share a database.
    The ``target`` fixture (tests/conftest.py) gives the one of the test's layer."""

    database_url: str | None = None
    memory: MemoryStore | None = field(default=None, repr=False)
    secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)

    def app(self, provider: Any = None, *, store: Any = None, **settings: Any) -> Litestar:
        """The app with ``settings`` (Settings' field names) and ``provider`` (the built-in
        fake unless one is handed in); ``store``: a PostgreSQL store of the test's own."""
        config = Settings(database_url=self.database_url, **settings)
        backend = None
        if self.database_url is None:
            self.memory = self.memory or memory_store(config)
            backend = memory_backend(self.memory, self.secret)
        elif store is not None:
            backend = postgres_backend(config, store=store)
        return create_app(config, provider=provider or FakeProvider(), backend=backend)

    async def stored(self, cid: UUID, owner: str = ANONYMOUS) -> Conversation | None:
        """A conversation as the store keeps it (what no route shows: its turns' origins)."""
        if self.database_url is None:
            assert self.memory is not None, "no app of this test made the store yet"
            return await self.memory.history.load(cid, owner)
        engine = create_engine(self.database_url, pool_size=1)
        try:
            return await PostgresStore.over(engine).history.load(cid, owner)
        finally:
            await engine.dispose()


@asynccontextmanager
async def sdk(
    target: Target | str, provider: Any = None, *, store: Any = None, **settings: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, Wire, httpx.AsyncClient]]:
    """An app served over loopback (on ``target``, or the database at that URL), the SDK
    pointed at its /v1 (no retries unless asked), every request the SDK sent, and a plain
    client for /api/v1."""
    retries = settings.pop("max_retries", 0)
    headers = settings.pop("headers", {})
    target = Target(target) if isinstance(target, str) else target
    app = target.app(provider, store=store, **settings)
    wire: Wire = []

    async def record(request: httpx.Request) -> None:
        wire.append(request)

    async with (
        serve(app) as url,
        httpx.AsyncClient(event_hooks={"request": [record]}, timeout=30, verify=TLS) as http,
        httpx.AsyncClient(base_url=url, timeout=30, headers=headers, verify=TLS) as plain,
    ):
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key=headers.get("Authorization", "Bearer x")[7:],
            max_retries=retries, http_client=http, _strict_response_validation=True,
        )  # fmt: skip
        yield client, wire, plain


TURN_KINDS = ("chat", "stream", "v1")  # a plain turn, a streamed one, a streamed /v1 response
_TERMINAL = {
    "stream": {"message.done", "error"},
    "v1": {"response.completed", "response.incomplete", "response.failed", "error"},
}


async def turn_outcome(
    client: httpx.AsyncClient, cid: str, kind: str, message: str
) -> tuple[int, str]:
    """One turn of ``kind`` (``TURN_KINDS``) on the conversation ``cid``: its HTTP status (a
    stream's: its response's) and how it ended: "ok", the error code, or what broke the
    contract ("broken stream": not exactly one terminal event, last; "message.done without a
    commit")."""
    if kind == "chat":
        response = await client.post(CHAT, json={"message": message, "conversation_id": cid})
        return response.status_code, "ok" if response.status_code == 200 else error_code(response)
    path, body = f"{CHAT}/stream", {"message": message, "conversation_id": cid}
    if kind == "v1":
        path = "/v1/responses"
        body = {"input": message, "conversation": f"conv_{UUID(cid).hex}", "stream": True}
    async with aconnect_sse(client, "POST", path, json=body) as source:
        status = source.response.status_code
        if status != 200:
            await source.response.aread()
            return status, error_code(source.response)
        events = [(e.event, json.loads(e.data)) async for e in source.aiter_sse() if e.data]
    names = [name for name, _ in events]
    if [i for i, name in enumerate(names) if name in _TERMINAL[kind]] != [len(events) - 1]:
        return status, f"broken stream {names[-3:]}"
    name, last = events[-1]
    if name == "error":
        return status, str(last.get("error", last)["code"])
    if kind == "stream" and last["revision"] is None:
        return status, "message.done without a commit"
    return status, "ok"


def error_code(response: httpx.Response) -> str:
    """The code of an error answer on either surface."""
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} without an error envelope"


def retries(metrics: str, model: str) -> float:
    """turnstore_provider_retries_total of ``model`` in a /metrics text (0 before any)."""
    series = f'turnstore_provider_retries_total{{model="{model}"}} '
    found = [line for line in metrics.splitlines() if line.startswith(series)]
    return float(found[0].removeprefix(series)) if found else 0.0
