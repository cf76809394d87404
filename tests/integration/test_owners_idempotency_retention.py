"""Owners, Idempotency-Key and retention over PostgreSQL: tests/contracts/owners_idempotency_retention.py, and what only the rows and the purge command show."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import ConversationNotFound
from service.core.model import Append, Removal
from service.store.postgres import PostgresStore, StoreConfig
from tests.conftest import ClientFactory
from tests.contracts.owners_idempotency_retention import *  # noqa: F403
from tests.contracts.owners_idempotency_retention import turn
from tests.support.helpers import CHAT, assert_error, snapshot


async def _age(engine: AsyncEngine, cid: str, days: float) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE conversations SET updated_at = now() - make_interval(days => :d) WHERE id = :id"
            ),
            {"d": days, "id": uuid.UUID(cid)},
        )


async def test_another_owners_conversation_is_not_found_everywhere(store: PostgresStore) -> None:
    cid = uuid.uuid4()
    await store.history.append(Append(cid, turn("alice's"), 0, owner="alice"))
    loaded = await store.history.load(cid, "alice")
    assert loaded is not None and loaded.owner == "alice"
    with pytest.raises(ConversationNotFound):
        await store.history.append(Append(cid, turn("bob's"), 1, owner="bob"))
    with pytest.raises(ConversationNotFound):
        await store.history.delete(Removal(cid, "bob"))
    page, _ = await store.reads.list_conversations("bob", 10)
    assert page == []
    await store.history.delete(Removal(cid, "alice"))
    assert await store.history.load(cid, "alice") is None


async def test_listing_pages_newest_first_with_a_cursor(store: PostgresStore) -> None:
    ids = [uuid.uuid4() for _ in range(5)]
    for cid in ids:  # created one after another: created_at increases
        await store.history.append(Append(cid, turn("x"), 0, owner="carol"))
    await store.history.append(Append(uuid.uuid4(), turn("not carol's"), 0, owner="dave"))
    seen: list[uuid.UUID] = []
    cursor: str | None = None
    for _ in range(5):
        page, cursor = await store.reads.list_conversations("carol", 2, cursor)
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == list(reversed(ids))


async def test_retention_hides_expired_conversations_at_once_and_purge_removes_only_them(
    make_client: ClientFactory, engine: AsyncEngine, database_url: str
) -> None:
    async with make_client(retention_days=30) as client:
        old = (await client.post(CHAT, json={"message": "old"})).json()["conversation_id"]
        fresh = (await client.post(CHAT, json={"message": "fresh"})).json()["conversation_id"]
        await _age(engine, old, 31)
        assert_error(
            await client.get(f"/api/v1/conversations/{old}"), 404, "conversation_not_found"
        )
        continued = await client.post(CHAT, json={"message": "more", "conversation_id": old})
        assert_error(continued, 404, "conversation_not_found")
        listed = (await client.get("/api/v1/conversations")).json()["conversations"]
        assert [c["conversation_id"] for c in listed] == [fresh]
    store = PostgresStore.over(engine, StoreConfig(retention_days=30))
    assert await store.ops.purge(batch=1) == 1
    rows: Any = await snapshot(engine)
    assert str(old) not in str(rows) and str(fresh) in str(rows)  # turns and replay items too
    assert await store.ops.purge() == 0


def test_the_purge_command(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.cli import main

    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("RETENTION_DAYS", "30")
    main(["purge"])
    assert capsys.readouterr().out.strip().startswith("purged ")
