"""Stored /v1 responses over PostgreSQL: tests/contracts/v1_responses.py, and what only the rows show (store: false keeps nothing; stored responses expire and are purged)."""

from __future__ import annotations

import uuid

import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.ids import Ids
from service.store.postgres import PostgresStore
from tests.contracts.v1_responses import *  # noqa: F403
from tests.contracts.v1_responses import conversation_of
from tests.support.helpers import sdk, snapshot


async def rows(engine: AsyncEngine) -> tuple[int, int, int]:
    """How many conversations, turns and runs are stored."""
    async with engine.connect() as conn:
        counts = [
            await conn.scalar(text(f"SELECT count(*) FROM {table}"))
            for table in ("conversations", "turns", "turn_runs")
        ]
    return counts[0], counts[1], counts[2]


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
