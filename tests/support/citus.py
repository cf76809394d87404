"""A local Citus cluster for the tests: a coordinator and workers (two unless asked) on loopback
ports.

Citus is an external engine here, as PostgreSQL is: `make citus-deps` builds it into the
system PostgreSQL 15 (`/work/shared/citus/build.sh`, as root with apt-get). Missing, the
tests that need it skip with one line (except in CI, where that would hide a broken install).

Each node is a `postgres` process started directly (not daemonised by pg_ctl), so it is this
process's child: stopped with a fast shutdown on the way out, and sent SIGQUIT by the kernel
if the test process dies without stopping it (no orphaned servers). PostgreSQL refuses to
run as root, so as root the nodes run as the same system user as the embedded server.
The data directories are copies of one initdb'd template (kept in the temp directory for
later sessions) in a scratch directory, removed afterwards: the data is throwaway, so fsync
is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from service.platform.embedded import _run_as_ids
from tests.support.cluster import free_port, workdir

PG_BIN = Path(os.environ.get("CITUS_PG_BIN", "/usr/lib/postgresql/15/bin"))
START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1
# WAL segments of 1 MB instead of 16: a data directory of 24 MB to copy, not 40.
_INITDB = ["-U", "postgres", "--auth=trust", "--no-locale", "--encoding=UTF8", "--no-sync",
           "--wal-segsize=1"]  # fmt: skip
_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",  # TCP only
    "shared_preload_libraries": "citus",
    "max_prepared_transactions": "100",  # two-phase commits across workers
    "wal_level": "logical",  # what Citus needs to move shards
    "max_connections": "200",  # several test pools, plus the coordinator's to the workers
    "shared_buffers": "32MB",
    "fsync": "off",
    "full_page_writes": "off",
    # Loopback only: no TLS between the nodes (Citus asks for it by default).
    "citus.node_conninfo": "sslmode=disable",
    # Two-phase commits stay recorded in pg_dist_transaction (the tests count them): nothing
    # here needs recovering.
    "citus.recover_2pc_interval": "-1",
}


def citus_missing() -> str | None:
    """Why no local Citus cluster can run here, or None."""
    if not (PG_BIN / "postgres").exists():
        return f"no PostgreSQL server at {PG_BIN} (apt-get install postgresql-15)"
    libdir = subprocess.run(
        [str(PG_BIN / "pg_config"), "--pkglibdir"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not (Path(libdir) / "citus.so").exists():
        return "Citus is not installed (`make citus-deps` builds it, as root with apt-get)"
    return None


def require_citus() -> None:
    if (reason := citus_missing()) is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@dataclass(frozen=True)
class Node:
    port: int
    data_dir: Path
    popen: subprocess.Popen[bytes]

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@dataclass(frozen=True)
class CitusCluster:
    coordinator: Node
    workers: tuple[Node, ...]

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.coordinator, *self.workers)


@contextmanager
def citus_cluster(
    workers: int = 2, settings: dict[str, str] | None = None
) -> Iterator[CitusCluster]:
    """A coordinator and ``workers`` workers running, with Citus loaded (``citus_database``
    makes a database that uses them); stopped and removed on the way out. ``settings``: the
    servers' settings over the tests' (the bench makes its writes durable again)."""
    with ExitStack() as stack:
        _remove_abandoned()
        root = stack.enter_context(workdir("citus"))
        stack.enter_context(_locked(root))
        ids = _run_as_ids()
        if ids is not None:
            os.chown(root, *ids)
        names = ("coordinator", *(f"worker{i}" for i in range(1, workers + 1)))
        _initdb(ids, [root / name for name in names])
        nodes = [stack.enter_context(_node(root / name, ids, settings)) for name in names]
        cluster = CitusCluster(nodes[0], tuple(nodes[1:]))
        asyncio.run(_wait_ready(cluster))
        yield cluster


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Held while the cluster lives: released by the kernel if this process dies."""
    with open(root / "in-use.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _remove_abandoned() -> None:
    """The scratch directories of test processes that were killed (their nodes died with
    them, see ``_node``), found by their lock being free."""
    for root in Path(tempfile.gettempdir()).glob("turnstore-citus-*"):
        try:
            with open(root / "in-use.lock") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(root, ignore_errors=True)
        except OSError:
            continue  # in use, or just being made


def stop(node: Node) -> None:
    """A node stopped as an operator would (a fast shutdown), its data kept: ``restarted``
    brings it back."""
    _stop(node.popen)


@contextmanager
def restarted(node: Node) -> Iterator[Node]:
    """A stopped node started again on its data directory and port (the coordinator knows it
    by them), ready; stopped on the way out."""
    with started_again(node) as again:
        asyncio.run(ready(again))
        yield again


@contextmanager
def started_again(node: Node) -> Iterator[Node]:
    """``restarted`` from a running event loop, not waited for (``ready`` waits). On the
    calling thread: the node gets SIGQUIT when the thread that started it ends."""
    with _node(node.data_dir, _run_as_ids(), port=node.port) as again:
        yield again


async def ready(node: Node) -> None:
    await _wait_ready(CitusCluster(node, ()))


@contextmanager
def _node(
    data_dir: Path,
    ids: tuple[int, int] | None,
    settings: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[Node]:
    port = port or free_port()
    chosen = {**_SETTINGS, **(settings or {}), "port": port}
    options = [f"-c{name}={value}" for name, value in chosen.items()]
    log = open(data_dir.parent / f"{data_dir.name}.log", "wb")  # noqa: SIM115 (closed below)
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent() -> None:  # in the child, after it became the PostgreSQL user
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGQUIT)

    popen = subprocess.Popen(
        [str(PG_BIN / "postgres"), "-D", str(data_dir), *options],
        **_as_pg_user(ids, data_dir.parent),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a Ctrl-C reaches the tests, which then stop the nodes
        preexec_fn=die_with_parent,  # a prctl, nothing else
    )
    try:
        yield Node(port, data_dir, popen)
    finally:
        _stop(popen)
        log.close()


def _stop(popen: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """A fast shutdown (SIGINT: sessions ended, a checkpoint); then immediate, then kill."""
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL):
        if popen.poll() is not None:
            return
        popen.send_signal(signum)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            continue


async def _wait_ready(cluster: CitusCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for node in cluster.nodes:
        while True:
            if node.popen.poll() is not None:
                log = node.data_dir.parent / f"{node.data_dir.name}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"postgres on {node.data_dir.name} exited:\n{tail}")
            try:
                conn = await asyncpg.connect(node.dsn(), timeout=2)
            except (OSError, asyncpg.CannotConnectNowError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{node.data_dir.name} did not start") from None
                await asyncio.sleep(0.05)
                continue
            await conn.close()
            break


@contextmanager
def citus_database(cluster: CitusCluster, workers: int | None = None) -> Iterator[str]:
    """A new database on every node with Citus in it and the workers added (``workers``: the
    first that many only, the others ready for a test to add): the URL of the coordinator's,
    dropped on the way out."""
    name = f"turnstore_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_each(cluster.nodes, f'CREATE DATABASE "{name}"'))
    try:
        asyncio.run(_form(cluster, name, cluster.workers[:workers]))
        yield cluster.coordinator.url(name)
    finally:
        asyncio.run(_each(cluster.nodes, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _each(nodes: tuple[Node, ...], statement: str, database: str = "postgres") -> None:
    async def run(node: Node) -> None:
        conn = await asyncpg.connect(node.dsn(database))
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    await asyncio.gather(*(run(node) for node in nodes))


async def _form(cluster: CitusCluster, database: str, workers: tuple[Node, ...]) -> None:
    await _each(cluster.nodes, "CREATE EXTENSION citus", database)
    conn = await asyncpg.connect(cluster.coordinator.dsn(database))
    try:
        coordinator = cluster.coordinator.port
        await conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', $1)", coordinator)
        for worker in workers:
            await conn.execute("SELECT citus_add_node('127.0.0.1', $1)", worker.port)
    finally:
        await conn.close()


def _initdb(ids: tuple[int, int] | None, data_dirs: list[Path]) -> None:
    """Copies of one initdb'd template, kept for later sessions: on a busy machine initdb
    takes seconds (its bootstrap is CPU-bound), a copy a fraction of that."""
    template = _template(ids)
    _all(ids, [["cp", "-a", str(template), str(data_dir)] for data_dir in data_dirs])


def _template(ids: tuple[int, int] | None) -> Path:
    """An empty cluster's data directory of this PostgreSQL, made once per machine and user
    (made beside it, then renamed into place: a concurrent session never sees half of it)."""
    initdb = [str(PG_BIN / "initdb"), *_INITDB]
    made_by = hashlib.sha256(" ".join(initdb).encode()).hexdigest()[:8]
    uid = ids[0] if ids else os.geteuid()
    template = Path(tempfile.gettempdir()) / f"turnstore-pg-template-{made_by}-{uid}"
    if (template / "PG_VERSION").exists():
        return template
    scratch = Path(tempfile.mkdtemp(prefix=f"{template.name}-", dir=template.parent))
    if ids is not None:
        os.chown(scratch, *ids)
    _all(ids, [[*initdb, "-D", str(scratch / "data")]])
    with contextlib.suppress(OSError):  # another session was first
        os.rename(scratch / "data", template)
    shutil.rmtree(scratch, ignore_errors=True)
    return template


def _all(ids: tuple[int, int] | None, commands: list[list[str]]) -> None:
    """Run ``commands`` at once as the PostgreSQL user; raise on the first that failed."""
    runs = [
        subprocess.Popen(
            command, **_as_pg_user(ids, Path("/")), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for command in commands
    ]
    for command, run in zip(commands, runs, strict=True):
        output, _ = run.communicate(timeout=START_TIMEOUT_S)
        if run.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({run.returncode}): {output.decode()}")


def _as_pg_user(ids: tuple[int, int] | None, home: Path) -> dict[str, Any]:
    """Popen's arguments to run a PostgreSQL program as the PostgreSQL user, with its own
    HOME (libpq, in the coordinator, would look for certificates in the caller's)."""
    return {
        "user": ids[0] if ids else None,
        "group": ids[1] if ids else None,
        "extra_groups": [] if ids else None,
        "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LC_ALL": "C"},
        "cwd": "/",
        "stdin": subprocess.DEVNULL,
    }
