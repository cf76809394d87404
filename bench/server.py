"""Start a server process for the bench and wait until it is ready; stop it afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from bench.http import Connection
from service.platform import migrate

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def process_cpu_s(pid: int) -> float:
    """A server's CPU time: its process and, with --workers, its worker processes."""
    process = psutil.Process(pid)
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        times = each.cpu_times()
        total += times.user + times.system
    return total


def turnstore_command() -> list[str]:
    """The installed `turnstore` script beside this interpreter."""
    script = Path(sys.executable).parent / "turnstore"
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


async def _ready(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            status, _ = await Connection(port).request("GET", "/readyz", close=True)
            if status == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the server on port {port} did not become ready")


# Every bench load is one owner's (AUTH_MODE=none) with up to 1,000 turns at once: the
# running-turn limit is raised past that, so each turn still takes its counted place
# (what the count costs is measured) and none is refused.
ONE_OWNER = {"OWNER_MAX_RUNNING_TURNS": "100000"}


@contextmanager
def running(command: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[int]:
    """Run ``command`` (a server on ``port``) until the block ends; yields its pid. With an
    external database the server does not migrate: do what an operator would first."""
    migrate.upgrade(env["DATABASE_URL"])
    env = {**os.environ, **ONE_OWNER, **env}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            asyncio.run(_ready(port, time.monotonic() + 60))
            yield process.pid
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
