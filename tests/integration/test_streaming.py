"""POST /api/v1/chat/stream over real HTTP (uvicorn on loopback, httpx-sse as the client):
event order, commit rules, disconnects, keep-alives and races."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx
from httpx_sse import aconnect_sse
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app, postgres_backend
from service.core.model import Append, Commit
from service.platform.settings import Settings
from service.store.postgres import Adapter, PostgresStore
from service.store.postgres.history import PostgresHistory
from tests.conftest import ClientFactory
from tests.support.database import admin
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import (
    CHAT,
    assert_error,
    failing_renewals,
    serve,
    snapshot,
    until_lease_expired,
)

STREAM = f"{CHAT}/stream"


async def stream(
    client: httpx.AsyncClient, **body: Any
) -> tuple[httpx.Response, list[tuple[str, Any]]]:
    """Run one stream to its end: the response and its (event, data) pairs."""
    async with aconnect_sse(client, "POST", STREAM, json=body) as source:
        events = [(sse.event, json.loads(sse.data)) async for sse in source.aiter_sse()]
        return source.response, events


def terminal(events: list[tuple[str, Any]]) -> tuple[str, Any]:
    names = [name for name, _ in events]
    assert names.count("message.done") + names.count("error") == 1, names
    assert names[-1] in ("message.done", "error"), names
    assert set(names[:-1]) <= {"message.delta"}, names
    return events[-1]


async def test_deltas_concatenate_to_the_committed_text_visible_at_once(
    client: httpx.AsyncClient,
) -> None:
    response, events = await stream(client, message="ping")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    name, done = terminal(events)
    assert name == "message.done"
    assert done["status"] == "completed" and done["incomplete_reason"] is None
    assert done["revision"] == 1
    cid = response.headers["x-conversation-id"]
    assert done["conversation_id"] == cid
    deltas = [data["delta"] for name, data in events if name == "message.delta"]
    assert len(deltas) > 1
    read = await client.get(f"/api/v1/conversations/{cid}")
    assert read.json()["messages"][-1]["content"] == "".join(deltas) == "[fake-llm] ping"

    _, events = await stream(client, message="again", conversation_id=cid)
    text = "".join(data["delta"] for name, data in events if name == "message.delta")
    assert text == "[fake-llm] again (history=2)" and events[-1][1]["revision"] == 2


async def test_max_output_tokens_commits_what_was_streamed(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(
        Script(status="incomplete", incomplete_reason="max_output_tokens", text="half a sen")
    )
    async with make_client(provider=api.provider()) as client:
        response, events = await stream(client, message="long")
        name, done = terminal(events)
        assert (name, done["status"], done["incomplete_reason"], done["revision"]) == (
            "message.done", "incomplete", "max_output_tokens", 1,
        )  # fmt: skip
        read = await client.get(f"/api/v1/conversations/{response.headers['x-conversation-id']}")
        assert read.json()["messages"][-1]["content"] == "half a sen"


FAILED_STREAMS = {
    "content-filter": (
        Script(status="incomplete", incomplete_reason="content_filter", text="bad"),
        None,
    ),
    "broken-stream": (Script(break_stream=True), "upstream_error"),
    "failed": (Script(status="failed"), "upstream_error"),
    "error-event": (Script(error_code="server_error"), "upstream_error"),
    "rate-limited": (Script(http_status=429), "rate_limited"),
    "timeout": (Script(exception=httpx.ReadTimeout("slow")), "upstream_timeout"),
}


async def test_problems_before_the_stream_are_json_errors(client: httpx.AsyncClient) -> None:
    assert_error(await client.post(STREAM, json={"message": ""}), 400, "invalid_input")
    unknown = {"message": "x", "conversation_id": "6a1f8f5e-0000-4000-8000-000000000000"}
    assert_error(await client.post(STREAM, json=unknown), 404, "conversation_not_found")
    # The conversation's check goes with the run's creation: a stale If-Match is 412 and
    # makes nothing; the current one streams the turn.
    cid = (await client.post(CHAT, json={"message": "hi"})).json()["conversation_id"]
    body = {"message": "x", "conversation_id": cid}
    stale = await client.post(STREAM, json=body, headers={"If-Match": '"0", "2"'})
    assert_error(stale, 412, "precondition_failed")
    assert "x-turn-id" not in stale.headers
    current = {"If-Match": '"1"'}
    async with aconnect_sse(client, "POST", STREAM, json=body, headers=current) as source:
        assert source.response.status_code == 200
        done = [json.loads(sse.data) async for sse in source.aiter_sse()][-1]
    assert done["revision"] == 2


async def test_keepalive_comments_during_long_silences(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    api.then(Script(gate=gate))
    async with (
        make_client(provider=api.provider(), sse_keepalive_s=0.05) as client,
        client.stream("POST", STREAM, json={"message": "slow"}) as response,
    ):
        lines = response.aiter_lines()
        assert await anext(lines) == ": keep-alive"
        gate.set()
        rest = [line async for line in lines]
    assert "event: message.done" in rest


async def test_two_streams_on_one_conversation_in_one_replica_are_serialised(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        _, events = await stream(client, message="start")
        cid = events[-1][1]["conversation_id"]
        gate = asyncio.Event()
        held = Script(gate=gate)
        api.then(held)
        first = asyncio.create_task(stream(client, message="a", conversation_id=cid))
        await held.started.wait()
        second = asyncio.create_task(stream(client, message="b", conversation_id=cid))
        gate.set()
        results = [await first, await second]
    assert [terminal(events)[1]["revision"] for _, events in results] == [2, 3]
    assert len(api.requests[2]["input"]) == len(api.requests[1]["input"]) + 3


async def test_failed_streams_leave_nothing(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        _, events = await stream(client, message="start")
        cid = events[-1][1]["conversation_id"]
        before = await snapshot(engine)
        for label, (script, code) in FAILED_STREAMS.items():
            for body in ({"conversation_id": cid}, {}):
                api.then(script)
                response, events = await stream(client, message="two", **body)
                assert response.status_code == 200, label
                name, data = terminal(events)
                if code is None:  # content filter: done, but nothing committed
                    assert name == "message.done", label
                    assert (data["status"], data["incomplete_reason"], data["revision"]) == (
                        "incomplete", "content_filter", None,
                    )  # fmt: skip
                else:
                    assert name == "error", label
                    assert data["error"]["code"] == code, label
                    assert data["error"]["correlation_id"] == response.headers["x-correlation-id"]
                assert await snapshot(engine) == before, label
                if not body:  # the provisional id of a failed new conversation never exists
                    provisional = response.headers["x-conversation-id"]
                    assert_error(
                        await client.get(f"/api/v1/conversations/{provisional}"),
                        404, "conversation_not_found",
                    )  # fmt: skip


async def test_client_disconnect_mid_stream_leaves_nothing_and_closes_upstream(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        _, events = await stream(client, message="start")
        cid = events[-1][1]["conversation_id"]
        before = await snapshot(engine)
        held = Script(stall=asyncio.Event())  # sends one delta, then waits
        api.then(held)
        async with aconnect_sse(
            client, "POST", STREAM, json={"message": "bye", "conversation_id": cid}
        ) as source:
            first = await anext(source.aiter_sse())
            assert first.event == "message.delta"  # incremental: the provider has not finished
        # The client is gone: the upstream stream must be closed promptly, nothing kept.
        await asyncio.wait_for(held.closed.wait(), timeout=5)
        assert await snapshot(engine) == before
        # The conversation lock was released: the next turn goes through.
        _, events = await stream(client, message="next", conversation_id=cid)
        assert events[-1] == ("message.done", {**events[-1][1], "revision": 2})


class PausingStore(PostgresHistory):
    """The real store's History, paused at the start of a commit until the test lets it go
    on."""

    def __init__(self, db: Adapter) -> None:
        super().__init__(db)
        self.committing = asyncio.Event()
        self.proceed = asyncio.Event()
        self.committed = asyncio.Event()

    async def append(self, append: Append) -> Commit:
        self.committing.set()
        await self.proceed.wait()
        commit = await super().append(append)
        self.committed.set()
        return commit


async def test_disconnect_during_the_commit_lets_the_commit_finish(
    database_url: str, engine: AsyncEngine
) -> None:
    """The documented resolution of the disconnect/commit race: once the reply is accepted and
    the commit has started, it runs to completion (all or nothing) and the turn is kept, as if
    message.done had been lost on the wire; then the conversation lock is released."""
    postgres = PostgresStore.over(engine)
    store = PausingStore(postgres.db)
    store.proceed.set()
    settings = Settings(database_url=database_url)
    seamed = replace(postgres, history=store)
    app = create_app(settings, backend=postgres_backend(settings, store=seamed))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        _, events = await stream(client, message="start")
        cid = events[-1][1]["conversation_id"]
        store.committing.clear()
        store.proceed.clear()
        store.committed.clear()
        body = {"message": "racing", "conversation_id": cid}
        async with aconnect_sse(client, "POST", STREAM, json=body) as source:
            async for sse in source.aiter_sse():
                assert sse.event == "message.delta"
                await store.committing.wait()  # deltas done, commit started: now hang up
                break
        store.proceed.set()
        await asyncio.wait_for(store.committed.wait(), timeout=5)
        after = await client.post(CHAT, json={"message": "after", "conversation_id": cid})
        assert after.status_code == 200 and after.json()["revision"] == 3
        messages = (await client.get(f"/api/v1/conversations/{cid}")).json()["messages"]
        assert [m["content"] for m in messages if m["role"] == "user"] == [
            "start",
            "racing",
            "after",
        ]


async def test_storage_failure_at_commit_is_an_error_event_and_nothing_is_written(
    make_client: ClientFactory, engine: AsyncEngine, server_url: str, database_url: str
) -> None:
    database = database_url.rsplit("/", 1)[1]
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        _, events = await stream(client, message="start")
        cid = events[-1][1]["conversation_id"]
        before = await snapshot(engine)
        gate = asyncio.Event()
        held = Script(gate=gate)
        api.then(held)
        task = asyncio.create_task(stream(client, message="doomed", conversation_id=cid))
        await held.started.wait()
        await admin(
            server_url,
            f'ALTER DATABASE "{database}" SET default_transaction_read_only = on',
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'",
        )
        try:
            gate.set()
            _, events = await task
        finally:
            await admin(
                server_url, f'ALTER DATABASE "{database}" RESET default_transaction_read_only'
            )
        name, data = terminal(events)
        assert (name, data["error"]["code"]) == ("error", "storage_error")
        assert await snapshot(engine) == before


async def test_across_replicas_the_stale_stream_ends_with_conflict(
    make_client: ClientFactory, engine: AsyncEngine, database_url: str
) -> None:
    """A stream whose lease ran out (its renewals could not reach the database) while another
    replica committed: it ends with conversation_conflict and writes nothing."""
    slow, fast = FakeResponsesAPI(), FakeResponsesAPI()
    settings = Settings(database_url=database_url, turn_lease_s=1)
    stale = create_app(
        settings,
        backend=postgres_backend(settings, store=failing_renewals(engine)),
        provider=slow.provider(),
    )
    async with (
        serve(stale) as stale_url,
        httpx.AsyncClient(base_url=stale_url, timeout=30) as one,
        make_client(provider=fast.provider()) as two,
    ):
        _, events = await stream(one, message="start")
        cid = events[-1][1]["conversation_id"]
        gate = asyncio.Event()
        held = Script(gate=gate)
        slow.then(held)
        loser = asyncio.create_task(stream(one, message="a", conversation_id=cid))
        await held.started.wait()
        await until_lease_expired(engine, cid)
        _, events = await stream(two, message="b", conversation_id=cid)
        assert terminal(events)[1]["revision"] == 2
        before = await snapshot(engine)
        gate.set()
        _, events = await loser
        name, data = terminal(events)
        assert (name, data["error"]["code"]) == ("error", "conversation_conflict")
        assert await snapshot(engine) == before
