"""Durable turns ("12. Durable turns"): a turn survives its client. Real `turnstore serve`
replicas on one database and the fake Responses API over loopback HTTP for what crosses
processes (resume elsewhere, cancel from elsewhere, a replica killed or stopped); in-process
apps on the test database for what one replica decides (owners, expiry, deletion, retries)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform import migrate
from service.store.postgres import PostgresStore, StoreConfig
from tests.cluster import (
    Replica,
    fake_api,
    provider_env,
    replica,
    replicas,
    turnstore_env,
    wait_ready,
    wait_until,
)
from tests.conftest import ClientFactory
from tests.database import fresh_database
from tests.fakeapi import FakeResponsesAPI, Script
from tests.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer, start

STREAM = f"{CHAT}/stream"
TURNS = "/api/v1/turns"
WORDS = [f"w{n} " for n in range(12)]


@pytest.fixture
def database(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        yield url


@dataclass(frozen=True)
class Event:
    id: int
    name: str
    data: dict[str, Any]


def event_of(sse: Any) -> Event | None:
    return (
        None
        if not sse.event or not sse.data
        else Event(int(sse.id), sse.event, json.loads(sse.data))
    )


async def follow(
    client: httpx.AsyncClient,
    turn_id: str,
    *,
    last_event_id: int | None = None,
    after: int | None = None,
) -> list[Event]:
    """A reader of the turn's events, to the end of its stream."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    params = {} if after is None else {"after": after}
    url = f"{TURNS}/{turn_id}/events"
    async with aconnect_sse(client, "GET", url, headers=headers, params=params) as source:
        assert source.response.status_code == 200, await source.response.aread()
        return [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]


def text_of(events: list[Event]) -> str:
    return "".join(e.data["delta"] for e in events if e.name == "message.delta")


def assert_one_terminal(events: list[Event]) -> Event:
    names = [e.name for e in events]
    assert names.count("message.done") + names.count("error") == 1, names
    assert names[-1] in ("message.done", "error"), names
    return events[-1]


async def background(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post(CHAT, json={"background": True, **body})
    assert response.status_code == 202, response.text
    return dict(response.json())


async def revision(client: httpx.AsyncClient, cid: str) -> int:
    return int((await client.get(f"/api/v1/conversations/{cid}")).json()["revision"])


async def status_becomes(
    client: httpx.AsyncClient, turn_id: str, status: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        view = (await client.get(f"{TURNS}/{turn_id}", headers=headers)).json()
        if view["status"] == status:
            return dict(view)
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.02)


# --- across replicas ---------------------------------------------------------------------------


async def test_a_dropped_stream_resumes_on_another_replica_with_last_event_id(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    async with replicas(database, tmp_path, api) as (a, b):
        cid = await start(a)
        api.then(Script(text="".join(WORDS), deltas=len(WORDS), drip_s=0.05))
        body = {"message": "slow", "conversation_id": cid, "background": True}
        async with aconnect_sse(a, "POST", STREAM, json=body) as source:
            turn_id = source.response.headers["X-Turn-Id"]
            seen: list[Event] = []
            async for sse in source.aiter_sse():
                if (event := event_of(sse)) is not None:
                    seen.append(event)
                if len(seen) == 3:
                    break  # the phone switched networks
        rest = await follow(b, turn_id, last_event_id=seen[-1].id)
        events = seen + rest
        assert [e.id for e in events] == list(range(1, len(events) + 1))  # none lost, none twice
        done = assert_one_terminal(events)
        assert done.name == "message.done", done
        assert done.data["turn_id"] == turn_id and done.data["revision"] == 2
        view = (await b.get(f"/api/v1/conversations/{cid}")).json()
        assert text_of(events) == view["messages"][-1]["content"] == "".join(WORDS)


async def test_background_chat_answers_202_at_once_and_the_turn_completes(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    async with replicas(database, tmp_path, api) as (a, b):
        cid = await start(a)
        held = Script(text="done in the background", gate=gate)
        api.then(held)
        accepted = await background(a, message="later", conversation_id=cid)
        assert accepted["conversation_id"] == cid
        assert accepted["status"] in ("queued", "in_progress")
        turn_id = accepted["turn_id"]
        await held.started.wait()
        running = (await b.get(f"{TURNS}/{turn_id}")).json()
        assert running["status"] == "in_progress" and running["revision"] is None
        gate.set()
        done = await status_becomes(b, turn_id, "completed")
        assert done == {
            "turn_id": turn_id,
            "conversation_id": cid,
            "status": "completed",
            "revision": 2,
            "message": "done in the background",
            "error": None,
        }
        messages = (await b.get(f"/api/v1/conversations/{cid}")).json()["messages"]
        assert [m["content"] for m in messages[2:]] == ["later", "done in the background"]


async def test_cancel_from_another_replica_stops_the_turn_within_a_second(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    stall = asyncio.Event()
    async with replicas(database, tmp_path, api) as (a, b):
        cid = await start(a)
        stalled = Script(text="never finished", deltas=4, stall=stall)
        api.then(stalled)
        body = {"message": "stop me", "conversation_id": cid}
        async with aconnect_sse(a, "POST", STREAM, json=body) as source:
            turn_id = source.response.headers["X-Turn-Id"]
            events = source.aiter_sse()
            first = event_of(await anext(events))
            assert first is not None and first.name == "message.delta"
            asked = time.monotonic()
            cancelled = await b.post(f"{TURNS}/{turn_id}/cancel")
            rest = [e async for sse in events if (e := event_of(sse)) is not None]
            took = time.monotonic() - asked
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert cancelled.json()["error"]["code"] == "cancelled"
        assert took < 1.0, took
        assert [e.name for e in rest] == ["error"] and rest[0].data["error"]["code"] == "cancelled"
        await asyncio.wait_for(stalled.closed.wait(), 1.0)  # the upstream request was closed
        assert await revision(b, cid) == 1  # nothing committed
        # Cancelling a finished turn changes nothing.
        again = await a.post(f"{TURNS}/{turn_id}/cancel")
        assert again.json() == cancelled.json()
        assert (await a.post(CHAT, json={"message": "next", "conversation_id": cid})).json()[
            "revision"
        ] == 2


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_a_background_turn_whose_replica_stops_ends_interrupted_for_every_reader(
    database: str, tmp_path: Path, how: str
) -> None:
    lease_s = 2.0
    api = FakeResponsesAPI()
    async with fake_api(api) as base_url:
        env = turnstore_env(
            DATABASE_URL=database,
            TURN_LEASE_S=str(lease_s),
            SHUTDOWN_GRACE_S="1",
            **provider_env(base_url),
        )
        with ExitStack() as stack:
            doomed = stack.enter_context(replica(env, tmp_path / "doomed.log"))
            survivor = stack.enter_context(replica(env, tmp_path / "survivor.log"))
            await asyncio.gather(wait_ready(doomed), wait_ready(survivor))
            async with (
                httpx.AsyncClient(base_url=doomed.url, timeout=60) as a,
                httpx.AsyncClient(base_url=survivor.url, timeout=60) as b,
            ):
                cid = await start(a)
                stall = asyncio.Event()  # never let go: the replica stops first
                stalled = Script(text="lost with its replica", deltas=3, stall=stall)
                api.then(stalled)
                key = {"Idempotency-Key": f"doomed-{how}"}
                asked = {"message": "doomed", "conversation_id": cid, "background": True}
                first = await a.post(CHAT, json=asked, headers=key)
                assert first.status_code == 202, first.text
                turn_id = first.json()["turn_id"]
                reader = asyncio.ensure_future(follow(b, turn_id))
                await stalled.started.wait()
                doomed.process.signal(getattr(signal, how))
                stopped = time.monotonic()
                events = await asyncio.wait_for(reader, lease_s + 10)
                took = time.monotonic() - stopped
                stall.set()
                end = assert_one_terminal(events)
                assert end.name == "error" and end.data["error"]["code"] == "turn_interrupted"
                # A request's correlation id, never the owner's name (it was, once).
                assert end.data["error"]["correlation_id"] not in ("", "anonymous")
                assert took < lease_s + 3, took
                view = (await b.get(f"{TURNS}/{turn_id}")).json()
                assert (view["status"], view["error"]["code"]) == ("failed", "turn_interrupted")
                # Its Idempotency-Key was freed when it ended: a retry runs the turn anew.
                retried = await b.post(CHAT, json=asked, headers=key)
                assert retried.status_code == 202, retried.text
                assert retried.json()["turn_id"] != turn_id
                assert retried.json()["conversation_id"] == cid
                done = await status_becomes(b, retried.json()["turn_id"], "completed")
                assert done["revision"] == 2  # nothing of the interrupted turn was kept


async def test_a_plain_turns_key_is_free_again_soon_after_its_replica_dies(
    database: str, tmp_path: Path
) -> None:
    """A plain turn with an Idempotency-Key waits for the provider when its replica is killed:
    its claim is no longer renewed, and a retry on another replica runs the turn within
    TURN_LEASE_S and a little (it was held for read timeout x rounds + 60 s, 420 s)."""
    lease_s = 2.0
    api = FakeResponsesAPI()
    async with fake_api(api) as base_url:
        env = turnstore_env(
            DATABASE_URL=database, TURN_LEASE_S=str(lease_s), **provider_env(base_url)
        )
        with ExitStack() as stack:
            doomed = stack.enter_context(replica(env, tmp_path / "doomed.log"))
            survivor = stack.enter_context(replica(env, tmp_path / "survivor.log"))
            await asyncio.gather(wait_ready(doomed), wait_ready(survivor))
            async with (
                httpx.AsyncClient(base_url=doomed.url, timeout=60) as a,
                httpx.AsyncClient(base_url=survivor.url, timeout=60) as b,
            ):
                cid = await start(a)
                held = Script(text="never answered", gate=asyncio.Event())
                api.then(held)
                key, asked = {"Idempotency-Key": "plain"}, {"message": "x", "conversation_id": cid}
                lost = asyncio.ensure_future(a.post(CHAT, json=asked, headers=key))
                await held.started.wait()
                doomed.process.signal(signal.SIGKILL)
                killed = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    await lost
                busy = await b.post(CHAT, json=asked, headers=key)
                assert busy.status_code == 409 and busy.json()["error"]["code"] == (
                    "request_in_progress"
                )
                while (retried := await b.post(CHAT, json=asked, headers=key)).status_code == 409:
                    assert time.monotonic() - killed < lease_s + 5, "the key stayed claimed"
                    await asyncio.sleep(0.1)
                took = time.monotonic() - killed
                assert retried.status_code == 200, retried.text
                assert took < lease_s + 5, took


async def test_on_sigterm_a_background_turn_may_finish_within_the_grace_period(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    async with fake_api(api) as base_url:
        env = turnstore_env(DATABASE_URL=database, SHUTDOWN_GRACE_S="20", **provider_env(base_url))
        with ExitStack() as stack:
            stopping = stack.enter_context(replica(env, tmp_path / "stopping.log"))
            other = stack.enter_context(replica(env, tmp_path / "other.log"))
            await asyncio.gather(wait_ready(stopping), wait_ready(other))
            async with (
                httpx.AsyncClient(base_url=stopping.url, timeout=60) as a,
                httpx.AsyncClient(base_url=other.url, timeout=60) as b,
            ):
                cid = await start(a)
                gate = asyncio.Event()
                held = Script(text="finished while stopping", gate=gate)
                api.then(held)
                turn_id = (await background(a, message="deploy", conversation_id=cid))["turn_id"]
                reader = asyncio.ensure_future(follow(b, turn_id))
                await held.started.wait()
                stopping.process.signal(signal.SIGTERM)
                await wait_until(lambda: logged(stopping, "Shutting down"), "SIGTERM heard", 10)
                gate.set()
                events = await asyncio.wait_for(reader, 20)
                assert await stopping.process.wait(20) == 0
        done = assert_one_terminal(events)
        assert done.name == "message.done" and done.data["revision"] == 2, done
        assert text_of(events) == "finished while stopping"


async def logged(where: Replica, text: str) -> bool:
    return text in where.process.tail(200)


# --- one replica ---------------------------------------------------------------------------------


async def test_a_reader_after_the_end_gets_the_whole_stream_until_its_events_expire(
    make_client: ClientFactory,
) -> None:
    async with make_client(turn_events_ttl_s=1) as client:
        async with aconnect_sse(client, "POST", STREAM, json={"message": "hello"}) as source:
            turn_id = source.response.headers["X-Turn-Id"]
            live = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert [e.id for e in live] == list(range(1, len(live) + 1))
        assert live[-1].data["turn_id"] == turn_id
        assert await follow(client, turn_id) == live
        assert await follow(client, turn_id, after=2) == live[2:]
        assert await follow(client, turn_id, last_event_id=len(live)) == []
        deadline = time.monotonic() + 10
        while (await client.get(f"{TURNS}/{turn_id}")).status_code == 200:
            assert time.monotonic() < deadline, "the events never expired"
            await asyncio.sleep(0.1)
        assert_error(await client.get(f"{TURNS}/{turn_id}"), 404, "turn_not_found")
        assert_error(await client.get(f"{TURNS}/{turn_id}/events"), 404, "turn_not_found")


async def test_an_idempotency_key_retry_of_a_background_turn_names_the_same_turn(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(text="once", gate=gate)
    api.then(held)
    key = {"Idempotency-Key": "bg-retry-1"}
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "hi", "background": True}, headers=key)
        assert first.status_code == 202, first.text
        await held.started.wait()
        while_running = await client.post(
            CHAT, json={"message": "hi", "background": True}, headers=key
        )
        assert while_running.status_code == 202, while_running.text
        # The first attempt's conversation and status, not a new conversation's id.
        assert while_running.json() == {**first.json(), "status": "in_progress"}
        # A retry on the stream follows the running turn's events to their end.
        async with aconnect_sse(
            client, "POST", STREAM, json={"message": "hi", "background": True}, headers=key
        ) as source:
            assert source.response.status_code == 200, await source.response.aread()
            assert source.response.headers["X-Turn-Id"] == first.json()["turn_id"]
            gate.set()
            followed = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert followed[-1].name == "message.done" and text_of(followed) == "once"
        await status_becomes(client, first.json()["turn_id"], "completed")
        after = await client.post(CHAT, json={"message": "hi", "background": True}, headers=key)
        assert after.status_code == 202, after.text
        assert after.json() == {**first.json(), "status": "completed"}
        async with aconnect_sse(
            client, "POST", STREAM, json={"message": "hi", "background": True}, headers=key
        ) as source:
            assert source.response.headers["X-Turn-Id"] == first.json()["turn_id"]
            replayed = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert text_of(replayed) == "once"
    assert len(api.requests) == 1  # one provider call for all of it


async def test_only_the_owner_reads_or_cancels_a_turn(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    api.then(Script(gate=gate))
    async with make_client(provider=api.provider(), **JWT_SETTINGS) as client:
        alice, mallory = jwt_bearer("alice"), jwt_bearer("mallory")
        mine = {"message": "mine", "background": True}
        turn_id = (await client.post(CHAT, json=mine, headers=alice)).json()["turn_id"]
        unknown = "00000000-0000-4000-8000-000000000000"
        for target in (turn_id, unknown, "not-a-uuid"):
            for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
                response = await client.request(method, f"{TURNS}/{target}{path}", headers=mallory)
                assert_error(response, 404, "turn_not_found")
        gate.set()
        view = await status_becomes(client, turn_id, "completed", alice)
        assert view["revision"] == 1


async def runs_of(engine: AsyncEngine) -> dict[str, int]:
    """turn id -> number of logged events, of every run in the database."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT r.id::text, count(e.seq) FROM turn_runs r"
                " LEFT JOIN turn_events e"
                " ON e.conversation_id = r.conversation_id AND e.turn_id = r.id GROUP BY r.id"
            )
        )
        return {row[0]: row[1] for row in rows}


async def streamed_turn(client: httpx.AsyncClient) -> tuple[str, str]:
    """(turn id, conversation id) of a streamed turn, run to its end."""
    async with aconnect_sse(client, "POST", STREAM, json={"message": "hi"}) as source:
        events = [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]
        assert events[-1].name == "message.done", events
        return source.response.headers["X-Turn-Id"], source.response.headers["X-Conversation-Id"]


async def test_events_go_with_their_conversation_with_retention_and_once_expired(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    async with make_client() as client:
        kept, deleted, retired = [await streamed_turn(client) for _ in range(3)]
        assert set(await runs_of(engine)) == {kept[0], deleted[0], retired[0]}
        assert (await client.delete(f"/api/v1/conversations/{deleted[1]}")).status_code == 204
        assert_error(await client.get(f"{TURNS}/{deleted[0]}"), 404, "turn_not_found")
        assert set(await runs_of(engine)) == {kept[0], retired[0]}
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE conversations SET updated_at = now() - interval '31 days' WHERE id = :id"),
            {"id": uuid.UUID(retired[1])},
        )
    assert await PostgresStore.over(engine, StoreConfig(retention_days=30)).ops.purge() == 1
    assert set(await runs_of(engine)) == {kept[0]}
    assert (await runs_of(engine))[kept[0]] >= 2  # a delta and message.done, until they expire
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE turn_runs SET expires_at = now()"))
    await PostgresStore.over(engine).ops.purge()
    assert await runs_of(engine) == {}
