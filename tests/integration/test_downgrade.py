"""`turnstore db downgrade` on a database with real rows: it prints what each migration it
undoes would delete, refuses (exit 1, nothing changed) without --allow-data-loss when that is
anything, and performs it with the flag; a downgrade that loses nothing needs no flag. Every
migration states what its downgrade destroys (``losses``), on a database at its own
revision."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path

import asyncpg
import httpx
from alembic.script import ScriptDirectory

from service.app import create_app, run_with_api_keys
from service.platform import migrate
from service.platform.settings import Settings
from tests.support.cluster import TURNSTORE, process, turnstore_env
from tests.support.database import asyncpg_dsn, fresh_database
from tests.support.helpers import serve


async def _rows(url: str) -> None:
    """What the service writes: a keyed turn, a streamed turn (a run and its events), a
    `/v1` conversation with metadata and no turn yet, and an API key."""
    app = create_app(Settings(database_url=url))
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        keyed = await client.post(
            "/api/v1/chat", json={"message": "keyed"}, headers={"Idempotency-Key": "k-1"}
        )
        assert keyed.status_code == 200, keyed.text
        async with client.stream("POST", "/api/v1/chat/stream", json={"message": "s"}) as s:
            assert s.status_code == 200
            assert "message.done" in "".join([chunk async for chunk in s.aiter_text()])
        made = await client.post("/v1/conversations", json={"metadata": {"topic": "x"}})
        assert made.status_code == 200, made.text
    await asyncio.to_thread(run_with_api_keys, url, lambda keys: keys.create("alice"))


async def _count(url: str, sql: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


def _undone_down_to(target: str) -> list[str]:
    """The revisions a downgrade from head to ``target`` undoes, newest first."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    undone = []
    for revision in script.walk_revisions():
        if revision.revision == target:
            break
        undone.append(revision.revision)
    return undone


def _listed(output: str) -> dict[str, dict[str, int]]:
    """``  0009 doc: conversations 1, conversations.metadata 1`` -> {"0009": {...}}."""
    found: dict[str, dict[str, int]] = {}
    for line in output.splitlines():
        match = re.match(r"  (\w+) [^:]*: (.*)$", line)
        if match:
            said = match.group(2)
            found[match.group(1)] = (
                {}
                if said == "nothing"
                else {k: int(n) for k, n in (part.rsplit(" ", 1) for part in said.split(", "))}
            )
    return found


async def _run(args: list[str], log: Path, url: str) -> tuple[int, str]:
    with process([TURNSTORE, *args], log, turnstore_env(DATABASE_URL=url)) as proc:
        status = await proc.wait(60)
    return status, proc.tail(200)


async def test_refused_with_counts_then_performed_with_the_flag(
    database: str, tmp_path: Path
) -> None:
    await _rows(database)
    counts = {
        "done keys": await _count(database, "SELECT count(*) FROM idempotency_keys"),
        "runs": await _count(database, "SELECT count(*) FROM turn_runs"),
        "events": await _count(database, "SELECT count(*) FROM turn_events"),
    }
    assert counts["done keys"] == 1 and counts["runs"] >= 1 and counts["events"] >= 1

    status, output = await _run(["db", "downgrade", "0005"], tmp_path / "refused.log", database)
    assert status == 1, output
    listed = _listed(output)
    assert list(listed) == _undone_down_to("0005"), output
    assert listed["0009"] == {"conversations": 1, "conversations.metadata": 1}
    assert listed["0008"] == {"turn_runs": counts["runs"], "turn_events": counts["events"]}
    assert listed["0006"] == {"idempotency_keys": 1}
    assert listed["0011"] == listed["0010"] == listed["0007"] == {}
    assert output.strip().splitlines()[-1].startswith("turnstore db: refused:")
    assert "--allow-data-loss" in output and "Traceback" not in output
    # Nothing changed.
    assert (await _count(database, "SELECT count(*) FROM idempotency_keys")) == 1
    assert migrate.head_revision() in await asyncio.to_thread(migrate.current, database)

    flags = ["db", "downgrade", "0005", "--allow-data-loss"]
    status, output = await _run(flags, tmp_path / "performed.log", database)
    assert status == 0, output
    assert _listed(output)["0006"] == {"idempotency_keys": 1}
    assert (await _count(database, "SELECT count(*) FROM idempotency_keys")) == 0
    assert (await _count(database, "SELECT count(*) FROM conversations")) == 2  # not the empty one
    assert (await _count(database, "SELECT count(*) FROM api_keys")) == 1  # 0005 stays
    assert (await _count(database, "SELECT count(to_regclass('turn_runs'))")) == 0
    assert (await asyncio.to_thread(migrate.current, database)).startswith(
        "data schema: 0005 (behind"
    )


async def test_a_downgrade_that_loses_nothing_needs_no_flag(database: str, tmp_path: Path) -> None:
    await _rows(database)
    # Down to 0011 first (what this release added loses what its turns recorded), then one
    # migration that loses nothing.
    flags = ["db", "downgrade", "0011", "--allow-data-loss"]
    status, output = await _run(flags, tmp_path / "first.log", database)
    assert status == 0, output
    status, output = await _run(["db", "downgrade", "0010"], tmp_path / "down.log", database)
    assert status == 0, output
    assert _listed(output) == {"0011": {}}
    assert (await _count(database, "SELECT count(*) FROM idempotency_keys")) == 1


def test_every_migration_states_its_losses_at_its_own_revision(server_url: str) -> None:
    """``losses`` may only use what exists at its revision: it runs on a database migrated
    exactly that far, for every revision."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    revisions = list(reversed(list(script.walk_revisions())))
    with fresh_database(server_url) as url:
        for rev in revisions:
            assert callable(getattr(rev.module, "losses", None)), rev.revision
            migrate.upgrade(url, rev.revision)
            out = io.StringIO()
            migrate.downgrade(url, rev.down_revision or "base", stdout=out)
            assert f"  {rev.revision} " in out.getvalue(), out.getvalue()
            assert out.getvalue().endswith(": nothing\n"), out.getvalue()
            migrate.upgrade(url, rev.revision)
