"""Turn leases ("11. Turn leases"): two turns of one conversation meet the same way on every
replica. Real `turnstore serve` processes on one database, the fake Responses API over
loopback HTTP (so this process sees, and can hold back, every provider call); the renewal
failure through a store seam in an in-process app."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app, postgres_backend
from service.platform.settings import Settings
from service.store.postgres import Adapter, PostgresStore
from service.store.postgres.places import PostgresPlaces
from service.store.postgres.tx import sql
from service.usecases.leases import RELEASE_RETRY_S
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import (
    CHAT,
    assert_error,
    serve,
    stale_and_fresh,
    start,
    until_lease_expired,
)


def turn(client: httpx.AsyncClient, cid: str, message: str) -> asyncio.Task[httpx.Response]:
    body = {"message": message, "conversation_id": cid}
    return asyncio.ensure_future(client.post(CHAT, json=body))


async def test_a_holder_whose_lease_expired_loses_to_the_turn_that_took_it(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with stale_and_fresh(database_url, engine, api, turn_lease_s=1) as (a, b):
        cid = await start(a)
        a_gate, b_gate = asyncio.Event(), asyncio.Event()
        a_slow, b_slow = Script(gate=a_gate), Script(gate=b_gate)
        api.then(a_slow)
        a_turn = turn(a, cid, "stale holder")
        await a_slow.started.wait()
        await until_lease_expired(engine, cid)  # renewals fail: the lease runs out
        api.then(b_slow)
        b_turn = turn(b, cid, "took the lease")
        await b_slow.started.wait()  # B holds the lease now
        a_gate.set()
        assert_error(await a_turn, 409, "conversation_conflict")
        b_gate.set()
        assert (await b_turn).json()["revision"] == 2
        view = (await b.get(f"/api/v1/conversations/{cid}")).json()
        assert [m["content"] for m in view["messages"][::2]] == ["first", "took the lease"]


class RefusedReleases(PostgresPlaces):
    """A seam: this replica's lease release is a statement the server refuses for good (an
    undefined table, SQLSTATE 42P01, as Citus refuses what it does not support with 0A000);
    the tries are counted."""

    tries = 0

    def __init__(self, db: Adapter) -> None:
        super().__init__(db)
        db.sql.release_lease = sql(
            "UPDATE no_such_table SET lease_holder = NULL"
            " WHERE id = :cid AND lease_holder = :holder RETURNING lease_wanted"
        )

    async def release_lease(self, conversation_id: uuid.UUID, holder: uuid.UUID) -> None:
        self.tries += 1
        await super().release_lease(conversation_id, holder)


async def test_a_release_the_database_refuses_for_good_is_not_retried_and_logged_once(
    database_url: str, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeResponsesAPI()
    settings = Settings(database_url=database_url)
    store = PostgresStore.over(engine)
    refused = RefusedReleases(store.db)
    store = replace(store, places=refused)
    app = create_app(
        settings, backend=postgres_backend(settings, store=store), provider=api.provider()
    )
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        cid = await start(client)
        for _ in range(2):  # two turns that fail: each gives its lease back, refused
            api.then(Script(http_status=500, error_code="server_error"))
            failed = await client.post(CHAT, json={"message": "fails", "conversation_id": cid})
            assert failed.status_code == 502, failed.text
        await asyncio.sleep(4 * RELEASE_RETRY_S)  # a retry would have come meanwhile
    assert refused.tries == 2
    logged = [r for r in caplog.records if "refuses to give turn leases back" in r.getMessage()]
    assert len(logged) == 1 and "42P01" in logged[0].getMessage()
