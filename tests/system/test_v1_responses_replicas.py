"""Stored /v1 responses across `turnstore serve` replicas: chained, polled, resumed and cancelled on
another replica, and a killed replica's background response."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from tests.support.cluster import fake_api, provider_env, replica, turnstore_env, wait_ready
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import snapshot


@asynccontextmanager
async def fleet(
    database: str, tmp_path: Path, api: FakeResponsesAPI, count: int, **settings: str
) -> AsyncIterator[tuple[list[openai.AsyncOpenAI], list[Any]]]:
    """``count`` replicas on ``database`` calling ``api``: a strict SDK client for each, and
    the replicas (to stop one)."""
    async with fake_api(api) as base_url, AsyncExitStack() as clients:
        env = turnstore_env(DATABASE_URL=database, **provider_env(base_url), **settings)
        with ExitStack() as stack:
            started = [
                stack.enter_context(replica(env, tmp_path / f"replica-{n}.log"))
                for n in range(count)
            ]
            await asyncio.gather(*(wait_ready(r) for r in started))
            sdks = [
                await clients.enter_async_context(
                    openai.AsyncOpenAI(
                        base_url=f"{r.url}/v1",
                        api_key="x",
                        max_retries=0,
                        _strict_response_validation=True,
                    )
                )
                for r in started
            ]
            yield sdks, started


async def status_becomes(
    client: openai.AsyncOpenAI, response_id: str, status: str, timeout_s: float = 20
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.responses.retrieve(response_id)
        if response.status == status:
            return response
        assert time.monotonic() < deadline, f"{response_id} stayed {response.status}"
        await asyncio.sleep(0.05)


async def events_of(
    client: openai.AsyncOpenAI,
    response_id: str,
    arrived: asyncio.Event | None = None,
    **after: int,
) -> list[Any]:
    """A response's events to its end (``arrived``: set once the first one came)."""
    stream = await client.responses.retrieve(response_id, stream=True, **after)
    events = []
    async for event in stream:
        events.append(event)
        if arrived is not None:
            arrived.set()
    return events


async def test_a_stored_response_chains_on_another_replica(database: str, tmp_path: Path) -> None:
    async with fleet(database, tmp_path, FakeResponsesAPI(), 2) as ((a, b), _):
        first = await a.responses.create(input="on a")
        second = await b.responses.create(previous_response_id=first.id, input="on b")
        assert (await a.responses.retrieve(second.id)).previous_response_id == first.id
        items = [i.id async for i in b.responses.input_items.list(second.id)]
        assert len(items) == 1  # its own input; the history is the first response's
        assert second.output_text and second.conversation is None


async def test_a_background_response_is_polled_resumed_and_cancelled_on_another_replica(
    database: str, tmp_path: Path
) -> None:
    api = FakeResponsesAPI()
    async with fleet(database, tmp_path, api, 2) as ((a, b), _):
        release = asyncio.Event()
        stalled = Script(text="one two three four", deltas=4, stall=release)
        api.then(stalled)
        created = await a.responses.create(input="in the background", background=True)
        assert created.status == "queued" and created.background is True
        await stalled.started.wait()
        await status_becomes(b, created.id, "in_progress")
        # Both readers are following it live before the provider goes on.
        reading = [asyncio.Event(), asyncio.Event()]
        from_start = asyncio.ensure_future(events_of(b, created.id, reading[0]))
        suffix = asyncio.ensure_future(events_of(b, created.id, reading[1], starting_after=3))
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in reading)), 10)
        assert not from_start.done() and not suffix.done()
        release.set()
        full, tail = await asyncio.gather(from_start, suffix)
        numbers = [event.sequence_number for event in full]
        assert numbers == list(range(len(full)))
        assert full[0].type == "response.created" and full[-1].type == "response.completed"
        assert [e.model_dump() for e in tail] == [e.model_dump() for e in full[4:]]
        done = await a.responses.retrieve(created.id)
        assert done.status == "completed" and done.output_text == "one two three four"
        assert full[-1].response.output_text == done.output_text
        after_the_end = await events_of(a, created.id)  # replayed once it ended, too
        assert [e.model_dump() for e in after_the_end] == [e.model_dump() for e in full]

        engine = create_async_engine(database.replace("postgresql://", "postgresql+asyncpg://"))
        try:
            before = await snapshot(engine)
            hold = asyncio.Event()
            held = Script(text="never committed", deltas=3, stall=hold)
            api.then(held)
            doomed = await a.responses.create(input="cancel me", background=True)
            await held.started.wait()
            cancelled = await b.responses.cancel(doomed.id)
            assert cancelled.status == "cancelled"
            await asyncio.wait_for(held.closed.wait(), 10)  # the provider call was closed
            assert (await a.responses.retrieve(doomed.id)).status == "cancelled"
            assert await snapshot(engine) == before  # nothing committed
            with pytest.raises(openai.BadRequestError):
                await a.responses.create(previous_response_id=doomed.id, input="after it")
            again = await b.responses.cancel(created.id)  # a finished one: as it is
            assert again.status == "completed"
        finally:
            hold.set()
            await engine.dispose()


async def test_a_background_response_whose_replica_is_killed_fails_on_every_replica(
    database: str, tmp_path: Path
) -> None:
    lease_s = 2.0
    api = FakeResponsesAPI()
    settings = {"TURN_LEASE_S": str(lease_s), "SHUTDOWN_GRACE_S": "1"}
    async with fleet(database, tmp_path, api, 3, **settings) as ((doomed, b, c), started):
        stall = asyncio.Event()
        stalled = Script(text="lost with its replica", deltas=3, stall=stall)
        api.then(stalled)
        created = await doomed.responses.create(input="doomed", background=True)
        await stalled.started.wait()
        started[0].process.signal(signal.SIGKILL)
        killed = time.monotonic()
        failed = await status_becomes(b, created.id, "failed", timeout_s=lease_s + 10)
        assert time.monotonic() - killed < lease_s + 5
        assert (await c.responses.retrieve(created.id)).status == "failed"
        assert failed.error is not None and failed.error.code == "server_error"
        assert failed.error.message.startswith("turn_interrupted: ")
        with pytest.raises(openai.APIError) as replayed:  # the SDK raises the error event
            await events_of(c, created.id)
        assert "nothing was kept" in replayed.value.message
        stall.set()
