"""Ownership scoping, cursor listing, Idempotency-Key and retention, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import ConversationNotFound
from service.core.items import user_input_item
from service.core.model import Append, Turn
from service.store.postgres import PostgresStore
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, assert_error, snapshot


def turn(text_: str) -> Turn:
    return Turn(text_, f"re: {text_}", [user_input_item(text_)])


async def test_another_owners_conversation_is_not_found_everywhere(store: PostgresStore) -> None:
    cid = uuid.uuid4()
    await store.append(Append(cid, turn("alice's"), 0, owner="alice"))
    loaded = await store.load(cid, "alice")
    assert loaded is not None and loaded.owner == "alice"
    with pytest.raises(ConversationNotFound):
        await store.append(Append(cid, turn("bob's"), 1, owner="bob"))
    with pytest.raises(ConversationNotFound):
        await store.delete(cid, "bob")
    page, _ = await store.list_conversations("bob", 10)
    assert page == []
    await store.delete(cid, "alice")
    assert await store.load(cid, "alice") is None


async def test_listing_pages_newest_first_with_a_cursor(store: PostgresStore) -> None:
    ids = [uuid.uuid4() for _ in range(5)]
    for cid in ids:  # created one after another: created_at increases
        await store.append(Append(cid, turn("x"), 0, owner="carol"))
    await store.append(Append(uuid.uuid4(), turn("not carol's"), 0, owner="dave"))
    seen: list[uuid.UUID] = []
    cursor: str | None = None
    for _ in range(5):
        page, cursor = await store.list_conversations("carol", 2, cursor)
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == list(reversed(ids))


async def test_listing_through_http(client: httpx.AsyncClient) -> None:
    made = [
        (await client.post(CHAT, json={"message": f"m{n}"})).json()["conversation_id"]
        for n in range(3)
    ]
    first = (await client.get("/api/v1/conversations", params={"limit": 2})).json()
    assert [c["conversation_id"] for c in first["conversations"]] == made[::-1][:2]
    second = (
        await client.get("/api/v1/conversations", params={"limit": 2, "after": first["next"]})
    ).json()
    assert [c["conversation_id"] for c in second["conversations"]] == made[:1]
    assert second["next"] is None
    assert_error(
        await client.get("/api/v1/conversations", params={"after": "garbage!"}),
        400,
        "invalid_input",
    )
    assert_error(
        await client.get("/api/v1/conversations", params={"limit": 0}), 400, "invalid_input"
    )


async def test_an_idempotent_retry_returns_the_original_without_calling_the_model(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    async with (
        make_client(provider=api.provider()) as one,
        make_client(provider=api.provider()) as two,
    ):
        headers = {"Idempotency-Key": "retry-1"}
        first = await one.post(CHAT, json={"message": "bill me once"}, headers=headers)
        again = await two.post(
            CHAT, json={"message": "bill me once"}, headers=headers
        )  # other replica
        assert first.status_code == again.status_code == 200
        keep = ("conversation_id", "message", "revision", "status")
        assert {k: again.json()[k] for k in keep} == {k: first.json()[k] for k in keep}
        assert len(api.requests) == 1
        reused = await two.post(CHAT, json={"message": "something else"}, headers=headers)
        assert_error(reused, 422, "idempotency_key_reused")
        streamed = await two.post(
            f"{CHAT}/stream", json={"message": "bill me once"}, headers=headers
        )
        assert "event: message.done" in streamed.text and first.json()["message"] in streamed.text
        assert len(api.requests) == 1


async def test_concurrent_duplicates_one_runs_the_other_is_in_progress(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(gate=gate)
    api.then(held)
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "dup"}
        first = asyncio.create_task(client.post(CHAT, json={"message": "once"}, headers=headers))
        await held.started.wait()
        second = await client.post(CHAT, json={"message": "once"}, headers=headers)
        assert_error(second, 409, "request_in_progress")
        gate.set()
        assert (await first).status_code == 200
    assert len(api.requests) == 1


async def test_a_failed_turn_does_not_use_the_key_up(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(Script(http_status=500))
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "fails-first"}
        assert_error(
            await client.post(CHAT, json={"message": "x"}, headers=headers), 502, "upstream_error"
        )
        ok = await client.post(CHAT, json={"message": "x"}, headers=headers)
        assert ok.status_code == 200
    assert len(api.requests) == 2


async def _age(engine: AsyncEngine, cid: str, days: float) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE conversations SET updated_at = now() - make_interval(days => :d) WHERE id = :id"
            ),
            {"d": days, "id": uuid.UUID(cid)},
        )


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
    store = PostgresStore(engine, retention_days=30)
    assert await store.purge(batch=1) == 1
    rows: Any = await snapshot(engine)
    assert str(old) not in str(rows) and str(fresh) in str(rows)  # turns and replay items too
    assert await store.purge() == 0


def test_the_purge_command(
    database_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.cli import main

    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("RETENTION_DAYS", "30")
    main(["purge"])
    assert capsys.readouterr().out.strip().startswith("purged ")


async def test_the_stream_reports_idempotency_conflicts_as_json_before_it_starts(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(gate=gate)
    api.then(held)
    async with make_client(provider=api.provider()) as client:
        headers = {"Idempotency-Key": "stream-key"}
        first = asyncio.create_task(client.post(CHAT, json={"message": "a"}, headers=headers))
        await held.started.wait()
        running = await client.post(f"{CHAT}/stream", json={"message": "a"}, headers=headers)
        assert_error(running, 409, "request_in_progress")
        gate.set()
        assert (await first).status_code == 200
        reused = await client.post(f"{CHAT}/stream", json={"message": "b"}, headers=headers)
        assert_error(reused, 422, "idempotency_key_reused")
    assert len(api.requests) == 1
