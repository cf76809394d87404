"""SIGTERM to a real `turnstore serve`: it stops accepting, lets a non-streaming turn in flight
finish, ends an open stream with an `error` event (committing nothing), closes its pools and
exits 0 within the grace period."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.api.sse import TurnEvents, sse_events
from service.app import build_services
from service.core.model import ANONYMOUS, Origin
from service.core.plans import PlanRules, chat_request, make_plan
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.platform.shutdown import SHUTDOWN
from service.providers.base import Provider, ProviderEvent, ProviderRequest, Reply, TextDelta
from service.store.postgres import PostgresNotifications
from service.usecases.leases import Leases
from service.usecases.runs import TurnRuns
from service.usecases.turns import TurnService
from tests.support.cluster import (
    fake_api,
    provider_env,
    replica,
    turnstore_env,
    wait_ready,
    wait_until,
)
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.memory import MemoryStore

CHAT = "/api/v1/chat"
GRACE_S = 10


async def _stored(url: str) -> list[tuple[str, int, int]]:
    """(conversation id, revision, number of turns) of every conversation."""
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT c.id::text, c.revision, count(t.seq) FROM conversations c "
                    "LEFT JOIN turns t ON t.conversation_id = c.id GROUP BY c.id ORDER BY c.id"
                )
            )
            return [(row[0], row[1], row[2]) for row in rows]
    finally:
        await engine.dispose()


async def _refuses_connections(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            await client.get(f"{url}/healthz")
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError):
        # Accepted by the kernel just before the server closed its socket, then closed
        # unanswered by the shutdown: not served, and not refused yet either. Ask again.
        return False
    return False


async def test_sigterm_drains_turns_and_ends_streams_with_an_error_event(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    gate, stall = asyncio.Event(), asyncio.Event()
    slow = Script(text="slow reply", gate=gate)
    stalled = Script(text="this stream is cut short", deltas=4, stall=stall)
    api.then(Script(text="first reply"), stalled, slow)
    log = tmp_path / "serve.log"
    try:
        async with fake_api(api) as base_url:
            env = turnstore_env(
                DATABASE_URL=database, SHUTDOWN_GRACE_S=str(GRACE_S), **provider_env(base_url)
            )
            with replica(env, log) as server:
                await wait_ready(server)
                async with (
                    httpx.AsyncClient(base_url=server.url, timeout=20) as first,
                    httpx.AsyncClient(base_url=server.url, timeout=20) as waiting,
                    httpx.AsyncClient(base_url=server.url, timeout=20) as streaming,
                ):
                    created = await first.post(CHAT, json={"message": "first"})
                    assert created.status_code == 200, created.text
                    cid = created.json()["conversation_id"]

                    # A stream on that conversation, stalled after its first delta...
                    body = {"message": "streamed", "conversation_id": cid}
                    async with aconnect_sse(streaming, "POST", f"{CHAT}/stream", json=body) as sse:
                        events = sse.aiter_sse()
                        assert (await anext(events)).event == "message.delta"
                        # ...and a non-streaming turn of a new conversation, held by the provider.
                        slow_turn = asyncio.create_task(
                            waiting.post(CHAT, json={"message": "slow"})
                        )
                        await asyncio.wait_for(slow.started.wait(), 10)

                        server.process.signal(signal.SIGTERM)
                        sigterm_at = time.monotonic()
                        rest = await asyncio.wait_for(_collect(events), GRACE_S / 2)

                    # The stream ended at once with exactly one terminal event: an error.
                    assert [event.event for event in rest] == ["error"], rest
                    error = json.loads(rest[0].data)["error"]
                    assert error["code"] == "not_ready", error
                    assert "shutting down" in error["message"]
                    await asyncio.wait_for(stalled.closed.wait(), 5)  # upstream call closed

                    # No new connections, while the slow turn is still being served...
                    await wait_until(lambda: _refuses_connections(server.url), "refusal", 5)
                    assert not slow_turn.done()
                    # ...and once the provider answers, it completes and commits.
                    gate.set()
                    response = await asyncio.wait_for(slow_turn, 10)
                    assert response.status_code == 200, response.text + server.process.tail()
                    assert response.json()["message"] == "slow reply"
                    assert response.json()["revision"] == 1

                status = await server.process.wait(GRACE_S)
                assert status == 0, server.process.tail()
                assert time.monotonic() - sigterm_at < GRACE_S
                output = log.read_text()
                assert "Application shutdown complete" in output  # lifespan ran: pools closed
                assert "Cancel" not in output  # nothing was cut off at the grace deadline
    finally:
        gate.set()
        stall.set()

    # The stream's turn left no trace; the drained turn is there.
    stored = dict((c, (revision, turns)) for c, revision, turns in await _stored(database))
    assert stored.pop(cid) == (1, 1)
    assert list(stored.values()) == [(1, 1)]


async def _collect(events: AsyncIterator[ServerSentEvent]) -> list[ServerSentEvent]:
    return [event async for event in events]


# --- the same, in process: what a run's stream does when the shutdown flag is set ---------


class Stalling(Provider):
    """A provider that sends one delta, then never answers (unless ``done``)."""

    origin = Origin("stalling", "memory", "m")

    def __init__(self, *, done: bool) -> None:
        self.done, self.closed = done, asyncio.Event()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        try:
            yield TextDelta("partial")
            if self.done:
                yield Reply("partial", "completed", None, [])
                return
            await asyncio.Event().wait()
        finally:
            self.closed.set()

    async def close(self) -> None:
        return None


async def _stream(provider: Stalling, *, background: bool = False) -> AsyncIterator[Any]:
    store = MemoryStore()
    leases = Leases(store, store, store.notifications)
    turns = TurnService(store, provider, leases=leases)
    runs = TurnRuns(turns, store, store, store.notifications, heartbeat_s=30)
    plan = make_plan(
        PlanRules(max_message_chars=100),
        chat_request(ANONYMOUS, "hi", None, None, background=background),
    )
    started = await runs.start(plan, correlation_id="cid")
    assert started.run is not None
    rendering = TurnEvents("cid")
    return sse_events(
        started.run.follow(), rendering, 60, correlation_id="cid", follower=background
    )


async def test_a_shutdown_ends_an_open_stream_with_one_error_event() -> None:
    provider = Stalling(done=False)
    try:
        stream = await _stream(provider)
        assert (await anext(stream)).event == "message.delta"
        SHUTDOWN.set()
        rest = [message async for message in stream]
    finally:
        SHUTDOWN.clear()
    assert [m.event for m in rest] == ["error"]
    assert json.loads(str(rest[0].data))["error"]["code"] == "not_ready"
    assert provider.closed.is_set()  # the turn was stopped: the upstream call closed


async def test_the_pool_is_closed_after_everything_that_uses_it(database_url: str) -> None:
    """The listener pings through the pool: closed after the pool, a ping in between opened a
    connection in the disposed pool's successor that nobody closed (CI saw it as an unclosed
    socket, collected in some later test)."""
    services = build_services(Settings(database_url=database_url))
    try:
        owners = [getattr(close, "__self__", None) for close in reversed(services.closers)]
        kinds = [type(owner) for owner in owners]
        assert kinds.index(PostgresNotifications) < kinds.index(AsyncEngine)  # the pool's
    finally:
        await services.close()
