"""`turnstore db status` (the schemas against this release's heads, the placement on Citus; exit
0 only when all is as it should be), `db distribute`'s progress, and `db upgrade` pointed at a
Citus worker: one line, no traceback. On plain PostgreSQL and on the local Citus cluster
(tests/support/citus.py, skipped without it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

from service import cli
from service.platform import migrate
from service.store.postgres.placement import distribute
from tests.conftest import CITUS_SHARD_COUNT
from tests.support.citus import CitusCluster, citus_database
from tests.support.database import asyncpg_dsn


def status(
    url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    """`turnstore db status` against ``url``: its exit status and its standard output."""
    capsys.readouterr()
    monkeypatch.setenv("DATABASE_URL", url)
    code = 0
    try:
        cli.main(["db", "status", *args])
    except SystemExit as exit:
        code = int(exit.code or 0)
    return code, capsys.readouterr().out


def test_status_at_head_on_plain_postgresql(
    database: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = status(database, monkeypatch, capsys)
    head = migrate.head_revision()
    assert code == 0, out
    assert f"data schema: {head} (head)" in out
    assert "citus: not installed" in out and out.endswith("all is as it should be\n")
    code, out = status(database, monkeypatch, capsys, "--json")
    found = json.loads(out)
    assert code == 0 and found["ok"] and found["citus"] is None
    assert found["data_schema"] == {"at": [head], "head": head, "ok": True}


def test_status_behind_the_head_exits_1(
    empty_database: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.upgrade(empty_database, "0020")
    code, out = status(empty_database, monkeypatch, capsys)
    assert code == 1, out
    assert "data schema: 0020 (behind this release's head" in out
    assert out.endswith("NOT as it should be: see above\n")
    found = json.loads(status(empty_database, monkeypatch, capsys, "--json")[1])
    assert not found["ok"] and not found["data_schema"]["ok"] and found["keyring"]["ok"]


def test_status_on_a_placed_coordinator(
    citus_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = status(citus_url, monkeypatch, capsys, "--json")
    found = json.loads(out)
    assert code == 0, out
    assert found["citus"]["coordinator"] and found["citus"]["workers"] == 2
    assert found["citus"]["misplaced"] == {} and found["ok"]


def test_a_forgotten_distribute_shows_and_exits_1(
    citus: CitusCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Upgraded but never distributed: every table and function to place is named."""
    with citus_database(citus) as url:
        migrate.upgrade(url)
        code, out = status(url, monkeypatch, capsys)
        assert code == 1, out
        assert "not placed: run `turnstore db distribute`" in out
        assert "  conversations: not placed as it should be (distributed by id)" in out
        assert "  turnstore_commit_run(): not placed" in out
        asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        assert status(url, monkeypatch, capsys)[0] == 0


async def _rows(url: str, statement: str, *args: Any) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(statement, *args)
    finally:
        await conn.close()


def test_distribute_shows_each_table_and_how_long_it_locked(
    citus: CitusCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with citus_database(citus) as url:
        migrate.upgrade(url)
        insert = (
            "INSERT INTO conversations (id, revision, created_at, updated_at, owner)"
            " SELECT gen_random_uuid(), 0, now(), now(), 'o' FROM generate_series(1, 500)"
        )
        asyncio.run(_rows(url, insert))
        asyncio.run(_rows(url, "ANALYZE conversations"))
        monkeypatch.setenv("DATABASE_URL", url)
        cli.main(["db", "distribute", "--shard-count", str(CITUS_SHARD_COUNT)])
        out = capsys.readouterr().out
        assert out.startswith("placing ") and "in one transaction" in out.splitlines()[0]
        assert "] conversations: about 500 rows..." in out
        assert "the tables placed were locked for " in out.splitlines()[-1]


def test_upgrade_pointed_at_a_worker_says_so_in_one_line(
    citus_url: str,
    citus: CitusCluster,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    worker = citus.workers[0].url(citus_url.rsplit("/", 1)[1])
    monkeypatch.setenv("DATABASE_URL", worker)
    with pytest.raises(SystemExit) as exit:
        cli.main(["db", "upgrade"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("turnstore db: this is a Citus worker (group ") and err.count("\n") == 1
