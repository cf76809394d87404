"""turnstore on Citus (deploy/SCALE-OUT.md): the store contract, the run store's, the lease and
the durable-turn tests run again, unchanged, against the local Citus cluster (tests/citus.py:
a coordinator and two workers, migrated with `turnstore db upgrade` and placed with `turnstore
db distribute`). Where Citus is not installed they skip with one line (in CI they fail).

The tests are the other modules' own, imported here: this module only hands them the
cluster's database instead of plain PostgreSQL's (the fixtures below override those of the
same name). Tables are emptied between tests, as on plain PostgreSQL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform.crypto import MasterKeys
from service.platform.db import create_engine
from service.store.postgres import Keyring, PostgresRuns, PostgresStore
from tests.database import asyncpg_dsn
from tests.test_durable import *  # noqa: F403
from tests.test_leases import *  # noqa: F403
from tests.test_run_store import *  # noqa: F403
from tests.test_run_store import Stores
from tests.test_store import *  # noqa: F403

TABLES = "conversations, idempotency_keys, turn_runs, owner_keys, api_keys"

# Tests of plain PostgreSQL's own behaviour, not of the store's statements: where a lock
# wait shows (on Citus it happens on a worker, outside the coordinator's pg_stat_activity).
PLAIN_ONLY = ("test_two_real_transactions_race_exactly_one_wins",)
for _name in PLAIN_ONLY:
    globals().pop(_name, None)


async def _empty(url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(f"TRUNCATE {TABLES} CASCADE")
    finally:
        await conn.close()


@pytest.fixture
async def engine(citus_url: str) -> AsyncIterator[AsyncEngine]:
    await _empty(citus_url)
    engine = create_engine(citus_url, pool_size=5)
    yield engine
    await engine.dispose()


@pytest.fixture
def database(citus_url: str) -> Iterator[str]:
    """What the lease and durable-turn tests serve their replicas from."""
    import asyncio

    asyncio.run(_empty(citus_url))
    yield citus_url


def _keyring(engine: AsyncEngine, encrypted: bool) -> Keyring | None:
    if not encrypted:
        return None
    return Keyring(engine, MasterKeys({"k1": AESGCM(AESGCM.generate_key(bit_length=256))}, "k1"))


@pytest.fixture(params=["citus", "citus-encrypted"])
def contract_store(request: pytest.FixtureRequest, engine: AsyncEngine) -> PostgresStore:
    return PostgresStore(engine, keyring=_keyring(engine, request.param == "citus-encrypted"))


@pytest.fixture(params=["citus", "citus-encrypted"])
def stores(request: pytest.FixtureRequest, engine: AsyncEngine) -> Stores:
    keyring = _keyring(engine, request.param == "citus-encrypted")
    return Stores(
        PostgresRuns(engine, events_ttl_s=0.5, keyring=keyring),
        PostgresStore(engine, events_ttl_s=0.5, keyring=keyring),
    )
