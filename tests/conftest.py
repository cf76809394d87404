"""The fixtures every layer shares (tests/unit, tests/integration, tests/system), each defined
once (tests/unit/test_layers.py checks it). Where the database comes from:

    server_url            the PostgreSQL server (tests/support/database.py: TEST_DATABASE_URL,
                          else a container, else the embedded server), for the session
    template_url          a database migrated once per session with the real `alembic upgrade
                          head`: the template every other database of the session is copied from
    database_url          the database in-process apps and `engine` use, one for the session
                          (copied from the template); on Citus (a module marked `citus`) the
                          cluster's
    database              a database of the test's own (``CREATE DATABASE … TEMPLATE``: no
                          migration), dropped afterwards; on Citus the cluster's, emptied
    empty_database        a database of the test's own with no schema at all
    engine                an engine on ``database_url`` whose tables start empty
    target                where the test's apps keep their state: in tests/unit in memory, else
                          ``database_url`` (emptied); ``make_client`` and ``client`` serve on it

The unit layer needs none of them: a unit test that asks for one fails (pytest_fixture_setup).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

# What the fixtures use is imported where they use it: this module is loaded by every pytest
# process, xdist's controller too, which runs no test (importing all of it there held back
# the start of `make test-fast`'s workers by some 2.5 s); the test modules import it anyway.
if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from service.core.ids import Ids
    from service.providers.base import Provider
    from service.store.postgres import PostgresStore
    from tests.support.citus import CitusCluster
    from tests.support.helpers import Target
    from tests.support.previous_release import Release

UNIT = Path(__file__).resolve().parent / "unit"

# What a unit test may not ask for: each reaches a database server.
DATABASE_FIXTURES = frozenset(
    {
        "server_url", "template_url", "shared_database_url", "database_url", "database",
        "empty_database", "engine", "store", "citus",
        "citus_url", "previous_release",
    }
)  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> None:
    """A unit test that needs the database fails, whether it names the fixture or a fixture
    asks for it at run time (``request.getfixturevalue``). Session-scoped fixtures are set up
    outside this folder's hooks: they ask ``refuse_in_unit`` themselves."""
    if fixturedef.argname in DATABASE_FIXTURES:
        refuse_in_unit(request, fixturedef.argname)


def refuse_in_unit(request: pytest.FixtureRequest, name: str) -> None:
    item = getattr(request, "_pyfuncitem", None)  # the test that asked, at any scope
    if item is not None and UNIT in item.path.parents:
        pytest.fail(
            f"{item.nodeid} is a unit test but needs `{name}` (a database):"
            " it belongs in tests/integration",
            pytrace=False,
        )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A contract suite (tests/contracts/) runs over the backends the module that imports it
    names in ``BACKENDS``: ``memory`` (unit), ``postgres``, ``postgres-encrypted``, ``citus``,
    ``citus-encrypted``. Places among the running turns are never sealed: in clear only."""
    for name in ("contract_store", "stores", "counting_store"):
        if name in metafunc.fixturenames:
            backends = getattr(metafunc.module, "BACKENDS", None)
            assert backends, f"{metafunc.module.__name__} runs a contract: name its BACKENDS"
            if name == "counting_store":
                backends = [b for b in backends if not b.endswith("-encrypted")]
            metafunc.parametrize(name, backends, indirect=True)


def on_citus(request: pytest.FixtureRequest) -> bool:
    return request.node.get_closest_marker("citus") is not None


@pytest.fixture(scope="session")
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    refuse_in_unit(request, "server_url")
    from tests.support.database import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def template_url(request: pytest.FixtureRequest, server_url: str) -> Iterator[str]:
    """Migrated once for the session (the real `alembic upgrade head`); no test connects to
    it, so that it can be copied."""
    refuse_in_unit(request, "template_url")
    from service.platform import migrate
    from tests.support.database import fresh_database

    with fresh_database(server_url) as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(scope="session")
def shared_database_url(
    request: pytest.FixtureRequest, server_url: str, template_url: str
) -> Iterator[str]:
    refuse_in_unit(request, "shared_database_url")
    from tests.support.database import copied_database

    with copied_database(server_url, template_url) as url:
        yield url


@pytest.fixture(scope="module")
def database_url(request: pytest.FixtureRequest) -> str:
    """What in-process apps (``make_client``) and ``engine`` use: the session's database, or
    the Citus cluster's for a module marked ``citus``."""
    return str(request.getfixturevalue("citus_url" if on_citus(request) else "shared_database_url"))


@pytest.fixture
def database(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database of this test's own (what replicas in other processes serve from),
    copied from the template and dropped afterwards; on Citus the cluster's, emptied."""
    from tests.support.backends import CITUS_TABLES
    from tests.support.database import admin, copied_database

    if on_citus(request):
        url = str(request.getfixturevalue("citus_url"))
        asyncio.run(admin(url, f"TRUNCATE {CITUS_TABLES} CASCADE"))
        yield url
        return
    server, template = (
        request.getfixturevalue("server_url"),
        request.getfixturevalue("template_url"),
    )
    with copied_database(server, template) as url:
        yield url


@pytest.fixture
def empty_database(server_url: str) -> Iterator[str]:
    """A database of this test's own with no schema (not migrated)."""
    from tests.support.database import fresh_database

    with fresh_database(server_url) as url:
        yield url


@pytest.fixture(scope="session")
def previous_release(request: pytest.FixtureRequest) -> Release:
    """The release deploy/PREVIOUS_RELEASE names, checked out and installed (cached under
    .turnstore/releases/). A clone without that commit skips, except in CI."""
    refuse_in_unit(request, "previous_release")
    from tests.support.previous_release import Unavailable, prepare, previous_commit

    try:
        return prepare(previous_commit())
    except Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


# Shards per co-location group in the tests: routing shows with any count above one, and
# each shard costs time to make and to truncate (production: placement.DEFAULT_SHARD_COUNT).
CITUS_SHARD_COUNT = 8


@pytest.fixture(scope="session")
def citus(request: pytest.FixtureRequest) -> Iterator[CitusCluster]:
    """A local Citus cluster, a coordinator and two workers (tests/support/citus.py), for the
    session; the test skips, with the reason, where Citus is not installed."""
    refuse_in_unit(request, "citus")
    from tests.support.citus import citus_cluster, require_citus

    require_citus()
    with citus_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def citus_url(request: pytest.FixtureRequest, citus: CitusCluster) -> Iterator[str]:
    """A database on that cluster, migrated and placed as `turnstore db upgrade` and
    `turnstore db distribute` do it: the coordinator's URL."""
    refuse_in_unit(request, "citus_url")
    from service.platform import migrate
    from service.store.postgres.placement import distribute
    from tests.support.citus import citus_database

    with citus_database(citus) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        yield url


@pytest.fixture
async def engine(request: pytest.FixtureRequest, database_url: str) -> AsyncIterator[AsyncEngine]:
    """Committed data (race tests need it), so every test starts from empty tables."""
    from sqlalchemy import text

    from service.platform.db import create_engine
    from tests.support.backends import CITUS_TABLES, TABLES

    engine = create_engine(database_url, pool_size=5)
    async with engine.begin() as conn:
        await conn.execute(
            text(f"TRUNCATE {CITUS_TABLES if on_citus(request) else TABLES} CASCADE")
        )
    yield engine
    await engine.dispose()


@pytest.fixture
def store(engine: AsyncEngine) -> PostgresStore:
    from service.store.postgres import PostgresStore

    return PostgresStore.over(engine)


ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def target(request: pytest.FixtureRequest) -> Target:
    """Where this test's apps keep their state: in tests/unit a fresh in-memory store, else
    ``database_url`` with empty tables (``engine``)."""
    from tests.support.helpers import Target

    if UNIT in request.path.parents:
        return Target()
    request.getfixturevalue("engine")
    return Target(str(request.getfixturevalue("database_url")))


@pytest.fixture
def make_client(target: Target) -> ClientFactory:
    """A served app (over loopback, in this test's event loop) on the test's ``target``, with
    its own pool on a database: ``async with make_client(provider=..., **settings) as
    client``."""
    from tests.support.helpers import TLS, serve

    @asynccontextmanager
    async def factory(
        provider: Provider | None = None, **settings: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        app = target.app(provider, **settings)
        async with (
            serve(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30, verify=TLS) as client,
        ):
            yield client

    return factory


@pytest.fixture
async def ids(request: pytest.FixtureRequest, target: Target) -> Ids:
    """The ids every app of the test shows: under the test database's ``ids`` secret, as every
    app on it reads it, or the in-memory target's."""
    from service.core.ids import Ids
    from service.store.postgres.secrets import SecretsReader

    if target.database_url is None:
        return Ids(target.secret)
    engine: AsyncEngine = request.getfixturevalue("engine")
    return Ids((await SecretsReader(engine).get()).ids)


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as client:
        yield client
