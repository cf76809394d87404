"""A private PostgreSQL server whose life a test controls (issue 28): stopped, started and
restarted while replicas use it, made to refuse logins or to run out of connections, without
touching the shared server the other tests use.

``private_postgres()`` runs ``initdb`` into a temporary directory and starts one postmaster on a
free loopback port, with the binaries and the run-as-another-user rules of tests/support/replication.py
(as root, the server runs as the ``turnstore-pg`` system user). Everything is stopped and the
directory removed on the way out, also when the test failed.

The operations block (subprocesses, polling with deadlines): from a test whose app is served
in the same event loop, run them in ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import pytest

from service.platform.embedded import _check_reachable, _free_port, _run_as_ids
from tests.support.cluster import wait_until
from tests.support.replication import TIMEOUT_S, OnLoopback, pg_bin_dir, run_tool


class PrivatePostgres(OnLoopback):
    """One postmaster on a data dir of its own; see the module docstring."""

    def __init__(self, root: Path, bin_dir: Path, settings: str = "") -> None:
        self.root, self.bin_dir, self.settings = root, bin_dir, settings
        self.port = _free_port()
        self.data_dir = root / "data"
        self.log = root / "postgres.log"

    def init(self) -> None:
        """``initdb`` (as the PostgreSQL user when we are root)."""
        ids = _run_as_ids()
        if ids is not None:
            _check_reachable(self.bin_dir / "postgres", *ids)
            _check_reachable(self.root, *ids)
            os.chown(self.root, *ids)
        self.log.touch()
        if ids is not None:
            os.chown(self.log, *ids)
        initdb = ["-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-locale", "--no-sync"]
        self._run("initdb", "-D", str(self.data_dir), *initdb)

    def start(self) -> None:
        """Start the postmaster and return once it accepts connections (``pg_ctl -w``)."""
        (self.data_dir / "standby.signal").unlink(missing_ok=True)
        self._start("", wait=True)

    def start_standby(self, *, hot: bool) -> None:
        """Start the postmaster as a standby (``standby.signal``) with nothing to stream
        from: it stays in recovery until it is promoted or stopped. ``hot``: it serves
        read-only sessions; else (``hot_standby = off``) it answers every connection 57P03,
        as a server starting up does. Returns at once; the next ``start`` is an ordinary
        one."""
        standby = self.data_dir / "standby.signal"
        standby.write_text("")
        self.own(standby)
        self._start(f"-c hot_standby={'on' if hot else 'off'}", wait=False)

    def promote(self) -> None:
        """A standby promoted; it accepts writes when this returns."""
        self._run("pg_ctl", "promote", "-D", str(self.data_dir), "-w", "-t", str(int(TIMEOUT_S)))

    def _start(self, settings: str, *, wait: bool) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
        opts += f"-c fsync=off {self.settings} {settings}"
        start = ["start", "-D", str(self.data_dir), "-l", str(self.log), "-o", opts]
        self._run("pg_ctl", *start, "-w" if wait else "-W", "-t", str(int(TIMEOUT_S)))

    def stop(self, mode: str = "fast", *, wait: bool = True) -> None:
        """``fast``: every backend ends its session with FATAL 57P01 and the server shuts
        down cleanly; ``immediate``: the backends quit at once (crash recovery follows);
        ``smart`` (best without ``wait``): new connections are refused (57P03, shutting
        down) while the sessions open go on, and the server stops once they have ended."""
        args = ["stop", "-D", str(self.data_dir), "-m", mode]
        self._run("pg_ctl", *args, "-w" if wait else "-W", "-t", "30")

    def own(self, path: Path) -> None:
        """``path`` (in the data dir) is the server's, as when it runs as another user."""
        ids = _run_as_ids()
        if ids is not None:
            os.chown(path, *ids)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def hba(self, text: str) -> str:
        """Replace pg_hba.conf (applied by ``SELECT pg_reload_conf()`` or the next start);
        what it held."""
        path = self.data_dir / "pg_hba.conf"
        was = path.read_text()
        path.write_text(text)
        self.own(path)
        return was

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.running():
            stop = ["stop", "-D", str(self.data_dir), "-m", "immediate", "-w", "-t", "10"]
            self._run("pg_ctl", *stop, check=False)

    def _run(self, tool: str, *args: str, check: bool = True) -> int:
        return run_tool(self.bin_dir, self.root, tool, *args, check=check, log=self.log_tail)


@contextmanager
def private_postgres(settings: str = "") -> Iterator[PrivatePostgres]:
    """A started private server (``settings``: more ``-c name=value`` for the postmaster),
    stopped and removed on exit whatever happened; skipped without PostgreSQL binaries
    (except in CI)."""
    try:
        bin_dir = pg_bin_dir()
    except RuntimeError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    root = Path(tempfile.mkdtemp(prefix="turnstore-pg-")).resolve()
    server = PrivatePostgres(root, bin_dir, settings)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            server.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)


async def refused_with(server: PrivatePostgres) -> str | None:
    """The SQLSTATE a new connection is refused with now; None: accepted, "down": nothing
    listens."""
    try:
        conn = await asyncpg.connect(server.dsn, timeout=5)
    except asyncpg.PostgresError as exc:
        return str(exc.sqlstate)
    except (OSError, TimeoutError):
        return "down"
    await conn.close()
    return None


async def until_refused(server: PrivatePostgres, state: str | None) -> None:
    """Poll until a new connection gets ``state`` (see ``refused_with``)."""

    async def reached() -> bool:
        return await refused_with(server) == state

    await wait_until(reached, f"new connections to get {state or 'in'}", TIMEOUT_S)
