from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.core.ids import Ids
from service.platform import migrate
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.providers.base import Provider
from service.providers.fake import FakeProvider
from service.store.postgres import PostgresStore
from service.store.postgres.placement import distribute
from service.store.postgres.secrets import SecretsReader
from tests.citus import CitusCluster, citus_cluster, citus_database, require_citus
from tests.database import fresh_database, postgres_server
from tests.helpers import serve
from tests.previous_release import Release, Unavailable, prepare, previous_commit


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def previous_release() -> Release:
    """The release deploy/PREVIOUS_RELEASE names, checked out and installed (cached under
    .turnstore/releases/). A clone without that commit skips, except in CI."""
    try:
        return prepare(previous_commit())
    except Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """One database for the session, migrated with the real `alembic upgrade head`."""
    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        yield url


# Shards per co-location group in the tests: routing shows with any count above one, and
# each shard costs time to make and to truncate (production: placement.DEFAULT_SHARD_COUNT).
CITUS_SHARD_COUNT = 8


@pytest.fixture(scope="session")
def citus() -> Iterator[CitusCluster]:
    """A local Citus cluster, a coordinator and two workers (tests/citus.py), for the session;
    the test skips, with the reason, where Citus is not installed."""
    require_citus()
    with citus_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def citus_url(citus: CitusCluster) -> Iterator[str]:
    """A database on that cluster, migrated and placed as `turnstore db upgrade` and
    `turnstore db distribute` do it: the coordinator's URL."""
    with citus_database(citus) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        yield url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """Committed data (race tests need it), so every test starts from empty tables."""
    engine = create_engine(database_url, pool_size=5)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "TRUNCATE conversations, idempotency_keys, turn_runs, owner_keys,"
                " owner_tombstones, owner_forks, owner_turns CASCADE"
            )
        )
    yield engine
    await engine.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> PostgresStore:
    return PostgresStore.over(engine)


ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def make_client(database_url: str, engine: AsyncEngine) -> ClientFactory:
    """A served app with its own pool on the test database:
    ``async with make_client(provider=..., **settings) as client``."""

    @asynccontextmanager
    async def factory(
        provider: Provider | None = None, **settings: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        config = Settings(database_url=database_url, **settings)
        app = create_app(config, provider=provider or FakeProvider())
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client

    return factory


@pytest.fixture
async def ids(engine: AsyncEngine) -> Ids:
    """The test database's own ids (its ``ids`` secret, as every app on it reads it)."""
    return Ids((await SecretsReader(engine).get()).ids)


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as client:
        yield client
