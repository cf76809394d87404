"""Durable turns over PostgreSQL: tests/contracts/durable.py, and events that go with their conversation, with retention and once expired."""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.postgres import PostgresStore, StoreConfig
from tests.conftest import ClientFactory
from tests.contracts.durable import *  # noqa: F403
from tests.contracts.durable import streamed_turn
from tests.support.events import (
    TURNS,
)
from tests.support.helpers import assert_error


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
