"""deploy/CITUS-RUNBOOK.md's commands are real: each `turnstore` command line parses with the
CLI's own parser; on the local Citus cluster each SQL statement that only reads runs as
written, and each one that changes the cluster (adding a node, a rebalance) calls functions
Citus has, with a number of arguments they take; the defaults it quotes are Citus' own. And
the Kubernetes migration Job's script, with TURNSTORE_DISTRIBUTE=1, leaves a new coordinator
migrated and placed."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
import yaml

from service.cli import build_parser
from tests.support.citus import CitusCluster, citus_database
from tests.support.database import asyncpg_dsn

pytestmark = pytest.mark.citus

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "deploy" / "CITUS-RUNBOOK.md"
# What changes a cluster, or needs one in a given state: checked by name and arguments only.
CHANGES = re.compile(
    r"CREATE |\\c |citus_set_coordinator_host|citus_add_node|citus_rebalance_start"
    r"|citus_rebalance_stop|citus_update_node|recover_prepared_transactions"
)
CALL = re.compile(r"\b([a-z_][a-z0-9_]*)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", RUNBOOK.read_text(), re.S)


def statements() -> list[str]:
    """Every SQL statement of the runbook, inline ones (`SELECT ...;`) included."""
    text = RUNBOOK.read_text()
    code = "\n".join(blocks("sql")) + "\n" + "\n".join(re.findall(r"`(SELECT [^`]*;)`", text))
    lines = [line.split("--", 1)[0] for line in code.splitlines()]
    found = [" ".join(part.split()) for part in "\n".join(lines).split(";")]
    return [each for each in found if each]


def test_every_turnstore_command_parses() -> None:
    commands = [
        shlex.split(line.split("#", 1)[0])
        for block in blocks("sh")
        for line in block.splitlines()
        if line.startswith("turnstore ")
    ]
    assert len(commands) >= 3
    for command in commands:
        build_parser().parse_args(command[1:])  # exits 2 on what it does not know
    with pytest.raises(SystemExit):  # the check of the check
        build_parser().parse_args(["db", "distibute"])


def test_the_runbook_has_its_statements() -> None:
    found = statements()
    assert sum(bool(CHANGES.search(each)) for each in found) >= 6, found
    assert sum(not CHANGES.search(each) for each in found) >= 6, found


async def test_every_statement_runs_or_names_what_citus_has(citus_url: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(citus_url))
    try:
        for statement in statements():
            if not CHANGES.search(statement):
                await conn.fetch(statement)  # the reads, as written
                continue
            for name, arguments in CALL.findall(statement):
                await _check_call(conn, name, arguments, statement)
        await _check_call(conn, "citus_add_nod", "'h', 5432", "the check of the check", False)
    finally:
        await conn.close()


async def _check_call(
    conn: asyncpg.Connection, name: str, arguments: str, statement: str, real: bool = True
) -> None:
    given = len([a for a in arguments.split(",") if a.strip()])
    takes = await conn.fetch(
        "SELECT pronargs, pronargdefaults FROM pg_proc WHERE proname = $1", name
    )
    fits = any(t["pronargs"] - t["pronargdefaults"] <= given <= t["pronargs"] for t in takes)
    assert fits is real, f"{name}({arguments}) in: {statement}"


async def test_the_defaults_it_quotes_are_citus_own(citus_url: str) -> None:
    text = " ".join(RUNBOOK.read_text().split())
    conn = await asyncpg.connect(asyncpg_dsn(citus_url))
    try:
        for setting, quoted in (
            ("citus.node_connection_timeout", "30 s"),
            ("citus.recover_2pc_interval", "60 s"),
        ):
            assert f"`{setting}` ({quoted} by default)" in text
            boot = await conn.fetchval("SELECT boot_val FROM pg_settings WHERE name = $1", setting)
            assert f"{int(boot) // 1000} s" == quoted
    finally:
        await conn.close()


def test_the_migration_job_places_a_new_coordinator(citus: CitusCluster, tmp_path: Path) -> None:
    """deploy/k8s/migrate-job.yaml's script as written, with TURNSTORE_DISTRIBUTE=1, and this
    checkout's `turnstore`: the first run migrates and places every table and function (its
    last command, `db status`, exits 0 only then), the second finds nothing to do."""
    job = yaml.safe_load((ROOT / "deploy" / "k8s" / "migrate-job.yaml").read_text())
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    (script,) = migrate["args"]
    turnstore = tmp_path / "turnstore"
    turnstore.write_text(f'#!/bin/sh\nexec {sys.executable} -m service.cli "$@"\n')
    turnstore.chmod(0o755)
    with citus_database(citus) as url:
        env = {
            "PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DATABASE_URL": url,
            "TURNSTORE_DISTRIBUTE": "1",
        }  # fmt: skip
        command = [*migrate["command"], script]
        first, second = (
            subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
            for _ in range(2)
        )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "conversations: distributed by id" in first.stdout
    assert "all is as it should be" in first.stdout
    assert second.returncode == 0, second.stdout + second.stderr
    assert "nothing to do" in second.stdout and "all is as it should be" in second.stdout
