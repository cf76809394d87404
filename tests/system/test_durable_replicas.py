"""Durable turns ("12. Durable turns") across processes: real `turnstore serve` replicas on one
database and the fake Responses API over loopback HTTP (resume elsewhere, cancel from elsewhere, a
replica killed or stopped). What one replica decides is in tests/integration/test_durable.py."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.support.cluster import (
    Replica,
    fake_api,
    provider_env,
    replicas,
    served,
    turnstore_env,
    wait_until,
)
from tests.support.events import (
    STREAM,
    TURNS,
    WORDS,
    Event,
    assert_one_terminal,
    background,
    event_of,
    follow,
    revision,
    status_becomes,
    text_of,
)
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, start


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
        async with served(env, tmp_path, "doomed", "survivor") as (
            (doomed, a),
            (_, b),
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
        async with served(env, tmp_path, "doomed", "survivor") as (
            (doomed, a),
            (_, b),
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
        async with served(env, tmp_path, "stopping", "other") as (
            (stopping, a),
            (_, b),
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
