"""Migrations run for real: up, down and up again on an empty database; readiness follows."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sqlalchemy import text

from service.app import create_app
from service.platform import migrate
from service.platform.db import create_engine
from service.platform.settings import Settings
from tests.support.database import fresh_database
from tests.support.helpers import serve


async def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            )
            return {row[0] for row in rows}
    finally:
        await engine.dispose()


def test_upgrade_downgrade_upgrade_on_an_empty_database(server_url: str) -> None:
    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        keyring = {"owner_keys", "keyring_version"}
        assert {"conversations", "turns"} | keyring <= asyncio.run(_tables(url))
        assert migrate.current(url) == (
            f"data schema: {migrate.head_revision()} (head)\nkeyring: k001 (head)"
        )
        migrate.downgrade(url, "base")
        # The keyring is never downgraded: that would destroy every data key.
        assert asyncio.run(_tables(url)) == {"alembic_version"} | keyring
        migrate.upgrade(url)
        assert {"conversations", "turns"} <= asyncio.run(_tables(url))


async def test_readyz_flips_to_ready_once_migrated_without_restart(
    empty_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(Settings(database_url=empty_database))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        not_ready = await client.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json()["error"]["code"] == "not_ready"
        # The log says why, not just "not_ready: - sqlstate=None".
        head = migrate.head_revision()
        said = [r.getMessage() for r in caplog.records if r.name == "turnstore.api"]
        assert f"not_ready (The database schema is at nothing, not at {head}.)" in said[-1]
        await asyncio.to_thread(migrate.upgrade, empty_database)
        assert (await client.get("/readyz")).status_code == 200
        # A turn against the just-migrated schema works in the same process.
        assert (await client.post("/api/v1/chat", json={"message": "hi"})).status_code == 200


async def test_requests_to_a_replica_not_ready_are_503_not_500(empty_database: str) -> None:
    """What /readyz says, every route says while the schema is missing (a replica started
    before the migration, or reached past its readiness probe): 503 not_ready, which clients
    and load balancers retry, not 500 storage_error; once migrated, the same requests work."""
    from service.providers.fake import FakeProvider

    app = create_app(Settings(database_url=empty_database), provider=FakeProvider())
    requests = [
        ("POST", "/api/v1/chat", {"message": "hi"}),
        ("GET", "/api/v1/conversations", None),
        ("POST", "/v1/responses", {"model": "fake", "input": "hi"}),
    ]
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        for method, path, body in requests:
            response = await client.request(method, path, json=body)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"]["code"] == "not_ready", path
        await asyncio.to_thread(migrate.upgrade, empty_database)
        for method, path, body in requests:
            response = await client.request(method, path, json=body)
            assert response.status_code == 200, (path, response.text)


async def test_readyz_is_503_when_the_database_is_unreachable() -> None:
    app = create_app(Settings(database_url="postgresql://nobody@127.0.0.1:1/none"))
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        response = await client.get("/readyz")
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
