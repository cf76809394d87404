"""A /v1 response's life ("Responses: stored, chained, streamed"): stored by default, chained
by previous_response_id, relayed without a trace with store: false, streamed for every kind of
call, run in the background, resumed, cancelled, deleted, its input items paged, expired.

The official SDK under strict validation; real `turnstore serve` replicas on one database and
the fake Responses API over loopback HTTP for what crosses processes (another replica chains,
polls, resumes and cancels; a replica is killed under a background response)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from service.core.ids import Ids
from service.platform import migrate
from service.store.postgres import PostgresStore
from tests.cluster import fake_api, provider_env, replica, turnstore_env, wait_ready
from tests.database import fresh_database
from tests.fakeapi import FakeResponsesAPI, Script
from tests.helpers import sdk, snapshot


@pytest.fixture
def database(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        yield url


def conversation_of(ids: Ids, response_id: str) -> uuid.UUID:
    return ids.parse_response(response_id).conversation_id


async def rows(engine: AsyncEngine) -> tuple[int, int, int]:
    """How many conversations, turns and runs are stored."""
    async with engine.connect() as conn:
        counts = [
            await conn.scalar(text(f"SELECT count(*) FROM {table}"))
            for table in ("conversations", "turns", "turn_runs")
        ]
    return counts[0], counts[1], counts[2]


# --- one replica ---------------------------------------------------------------------------


async def test_a_response_without_a_conversation_is_stored_and_chained(
    database_url: str, engine: AsyncEngine, ids: Ids
) -> None:
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider()) as (client, _, _plain):
        first = await client.responses.create(input="hello", instructions="Be brief.")
        assert first.status == "completed" and first.store is True
        assert first.conversation is None  # as on OpenAI: a stored response has none
        again = await client.responses.retrieve(first.id)
        # The same Response, every time, but for the instructions: a turn keeps their digest
        # only (the contract's Responses: what a request may carry), so a retrieve shows none.
        assert again.model_dump() == {**first.model_dump(), "instructions": None}
        second = await client.responses.create(previous_response_id=first.id, input="more")
        # The model saw the first exchange, byte for byte, then the new message; the
        # instructions were the first response's alone.
        assert api.requests[1]["input"][:-1] == [*api.requests[0]["input"], *first_output(api)]
        assert "instructions" not in api.requests[1]
        assert second.previous_response_id == first.id
        assert conversation_of(ids, second.id) == conversation_of(ids, first.id)
        third = await client.responses.create(previous_response_id=first.id, input="edited")
        assert conversation_of(ids, third.id) != conversation_of(
            ids, first.id
        )  # an earlier one: a fork


def first_output(api: FakeResponsesAPI) -> list[Any]:
    """What the provider answered the first call, as its next input carries it."""
    return list(api.requests[1]["input"][len(api.requests[0]["input"]) : -1])


async def test_store_false_keeps_nothing_and_its_id_is_unknown_everywhere(
    database_url: str, engine: AsyncEngine
) -> None:
    async with sdk(database_url) as (client, _, _plain):
        await client.responses.create(input="kept")  # something stored, to compare against
        before = await snapshot(engine), await rows(engine)
        relayed = await client.responses.create(input="not kept", store=False)
        async with client.responses.stream(
            input="not kept either", store=False, model="fake-llm"
        ) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            streamed = await stream.get_final_response()
        assert (await snapshot(engine), await rows(engine)) == before
        assert relayed.store is False and relayed.output_text
        assert "".join(deltas) == streamed.output_text and streamed.store is False
        for gone in (relayed.id, streamed.id):
            with pytest.raises(openai.BadRequestError) as chained:
                await client.responses.create(previous_response_id=gone, input="next")
            assert chained.value.code == "previous_response_not_found"
            assert chained.value.param == "previous_response_id"
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(gone)
        assert (await snapshot(engine), await rows(engine)) == before


async def test_every_kind_of_call_streams_with_the_sdk_helper(
    database_url: str, engine: AsyncEngine, ids: Ids
) -> None:
    async with sdk(database_url) as (client, _, _plain):
        conversation = await client.conversations.create()
        kinds: dict[str, dict[str, Any]] = {
            "stored": {},
            "stateless": {"store": False},
            "in a conversation": {"conversation": conversation.id},
        }
        finals = {}
        for kind, fields in kinds.items():
            async with client.responses.stream(
                input=f"say {kind}", model="fake-llm", **fields
            ) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert final.status == "completed" and "".join(deltas) == final.output_text, kind
            finals[kind] = final
        chained = finals["stored"].id
        async with client.responses.stream(
            previous_response_id=chained, input="on", model="fake-llm"
        ) as stream:
            final = await stream.get_final_response()
        assert conversation_of(ids, final.id) == conversation_of(ids, chained)
        for kind in ("stored", "in a conversation"):  # kept: retrieved as streamed
            kept = await client.responses.retrieve(finals[kind].id)
            assert kept.output_text == finals[kind].output_text
            assert kept.created_at == finals[kind].created_at


async def test_delete_forgets_the_response_and_keeps_the_conversations_items(
    database_url: str, engine: AsyncEngine
) -> None:
    async with sdk(database_url) as (client, _, _plain):
        conversation = await client.conversations.create()
        response = await client.responses.create(conversation=conversation.id, input="one")
        items = [i.id async for i in client.conversations.items.list(conversation.id)]
        deleted = await client.responses.delete(response.id)
        assert deleted is None  # the SDK answers None for OpenAI's {"id", "deleted": true}
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(response.id)
        with pytest.raises(openai.BadRequestError) as chained:
            await client.responses.create(previous_response_id=response.id, input="two")
        assert chained.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(response.id)
        assert [i.id async for i in client.conversations.items.list(conversation.id)] == items
        # The conversation goes on.
        later = await client.responses.create(conversation=conversation.id, input="two")
        assert later.status == "completed"


async def test_input_items_page_like_openais(database_url: str, engine: AsyncEngine) -> None:
    said = [f"message {n}" for n in range(7)]
    async with sdk(database_url) as (client, _, _plain):
        response = await client.responses.create(
            input=[{"role": "user", "content": text} for text in said]
        )
        first = await client.responses.input_items.list(response.id, limit=3)
        assert first.has_more and len(first.data) == 3  # newest first by default
        newest_first = [i.content[0].text async for i in  # type: ignore[union-attr]
                        client.responses.input_items.list(response.id, limit=3)]  # fmt: skip
        assert newest_first == said[::-1]  # the SDK followed `after` across three pages
        oldest_first = await client.responses.input_items.list(
            response.id, order="asc", after=first.data[-1].id, limit=100
        )
        assert [i.content[0].text for i in oldest_first.data] == said[5:]  # type: ignore[union-attr]
        assert not oldest_first.has_more
        ascending = [i.content[0].text async for i in  # type: ignore[union-attr]
                     client.responses.input_items.list(response.id, order="asc", limit=2)]  # fmt: skip
        assert ascending == said
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_items.list(response.id, limit=101)
        assert refused.value.param == "limit"


async def test_stored_responses_expire_and_are_purged(
    database_url: str, engine: AsyncEngine, ids: Ids
) -> None:
    async with sdk(database_url, stored_response_ttl_days=1) as (client, _, _plain):
        conversation = await client.conversations.create()
        kept = await client.responses.create(conversation=conversation.id, input="no expiry")
        old = await client.responses.create(input="old")
        fresh = await client.responses.create(input="fresh")
        chained = await client.responses.create(previous_response_id=fresh.id, input="again")
        async with engine.begin() as conn:
            expiry = text("SELECT expires_at - now() FROM conversations WHERE id = :id")
            left = await conn.scalar(expiry, {"id": conversation_of(ids, chained.id)})
            assert 86_000 < left.total_seconds() <= 86_400  # moved on by its last turn
            assert await conn.scalar(expiry, {"id": conversation.id[5:]}) is None
            await conn.execute(
                text("UPDATE conversations SET expires_at = now() WHERE id = :id"),
                {"id": conversation_of(ids, old.id)},
            )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(old.id)  # gone at once
        with pytest.raises(openai.BadRequestError) as chaining:
            await client.responses.create(previous_response_id=old.id, input="too late")
        assert chaining.value.code == "previous_response_not_found"
        store = PostgresStore.over(engine)  # without RETENTION_DAYS, too
        assert await store.ops.purge() == 1
        assert await store.ops.purge() == 0
        async with engine.connect() as conn:
            stored = set((await conn.scalars(text("SELECT id FROM conversations"))).all())
        assert conversation_of(ids, old.id) not in stored
        assert {conversation_of(ids, fresh.id), uuid.UUID(conversation.id[5:])} <= stored
        assert (await client.responses.retrieve(kept.id)).output_text == kept.output_text


# --- replicas --------------------------------------------------------------------------------


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
