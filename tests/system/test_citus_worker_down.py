"""A Citus worker down and back (deploy/CITUS-RUNBOOK.md, section 3), on a cluster of this
test's own (tests/support/citus.py), a worker stopped as an operator would and started again:
the turns of its conversations answer `500 storage_error` and each replica log line names the
worker ("host:port", from Citus' error), never the client's body; the other worker's
conversations are served; once it is back, the same turns succeed without a restart."""

from __future__ import annotations

import asyncio
import re
from contextlib import ExitStack
from typing import Any

import asyncpg
import pytest
from litestar.testing import AsyncTestClient

from service.app import create_app
from service.platform import migrate
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from service.store.postgres.placement import distribute
from service.store.postgres.tx import worker_of
from tests.support.citus import (
    citus_cluster,
    citus_database,
    require_citus,
    restarted,
    stop,
)
from tests.support.database import asyncpg_dsn
from tests.support.helpers import CHAT

WHERE = (
    "SELECT nodeport FROM citus_shards"
    " WHERE shardid = get_shard_id_for_distribution_column($1, $2::text)"
)


def test_worker_down_and_back(caplog: pytest.LogCaptureFixture) -> None:
    require_citus()
    with citus_cluster() as cluster, ExitStack() as later, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        on = asyncio.run(_conversations_on_both_workers(url))
        # Either worker: the owner's own rows are the coordinator's (test_citus_owner_spread.py
        # stops each in turn).
        down = cluster.workers[-1]
        stop(down)

        answers = asyncio.run(_turns(url, on))
        address = f"127.0.0.1:{down.port}"
        for cid, port in on.items():
            status, body = answers[cid]
            if port == down.port:
                assert (status, body["error"]["code"]) == (500, "storage_error"), body
                assert str(down.port) not in str(body)
            else:
                assert status == 200, body
        lines = [r.getMessage() for r in caplog.records if r.name == "turnstore.api"]
        failed = [line for line in lines if line.startswith("storage_error")]
        assert len(failed) == sum(port == down.port for port in on.values()) > 0, lines
        assert all(line.endswith(f" worker={address}") for line in failed), failed

        later.enter_context(restarted(down))
        answers = asyncio.run(_turns(url, on))
        assert {status for status, _ in answers.values()} == {200}, answers


async def _conversations_on_both_workers(url: str) -> dict[str, int]:
    """Conversations made through the app until each worker holds some: id -> worker port."""
    on: dict[str, int] = {}
    async with _client(url) as client:
        while len(set(on.values())) < 2 or len(on) < 6:
            made = await client.post(CHAT, json={"message": "first"})
            assert made.status_code == 200, made.text
            cid = made.json()["conversation_id"]
            on[cid] = await _where(url, "conversations", cid)
    return on


async def _turns(url: str, on: dict[str, int]) -> dict[str, tuple[int, dict[str, object]]]:
    async with _client(url) as client:
        answers = {}
        for cid in on:
            turn = await client.post(CHAT, json={"message": "again", "conversation_id": cid})
            answers[cid] = (turn.status_code, turn.json())
    return answers


def _client(url: str) -> AsyncTestClient[Any]:
    app = create_app(Settings(database_url=url), provider=FakeProvider())
    return AsyncTestClient(app, base_url="http://127.0.0.1")


async def _where(url: str, table: str, value: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return int(await conn.fetchval(WHERE, table, value))
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("message", "context", "worker"),
    [
        (
            "connection to the remote node postgres@10.0.0.5:5432 failed with the following"
            " error: Connection refused",
            None,
            "10.0.0.5:5432",
        ),
        (
            "could not establish any connections to the node w-2.internal:6432 after 30000 ms",
            None,
            "w-2.internal:6432",
        ),
        (
            "canceling statement due to statement timeout",
            "while executing command on 10.0.0.7:5432",
            "10.0.0.7:5432",
        ),
        ('duplicate key value violates unique constraint "k"', None, None),
    ],
)
def test_the_worker_is_read_from_what_citus_says(
    message: str, context: str | None, worker: str | None
) -> None:
    error = asyncpg.PostgresError(message)
    error.message, error.context = message, context  # as asyncpg fills them from the server
    assert worker_of(error) == worker
    assert re.fullmatch(r"\S+:\d+", worker or "h:1")
