"""Real processes for the multi-process tests: `turnstore serve` replicas, the fake Responses
API served over loopback HTTP, nginx as load balancer and PgBouncer in transaction mode.

Whatever a context manager here starts, it stops on the way out, also when the test failed:
first politely (SIGTERM), then with SIGKILL after a bounded wait. Waiting is always polling
with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import serve

REPO = Path(__file__).resolve().parents[2]
TURNSTORE = str(Path(sys.executable).with_name("turnstore"))
SBIN = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def system_tool(name: str, package: str) -> str:
    """The path of a Debian tool that `make test` installs (`make system-deps`). Missing, the
    test is skipped, except in CI, where that would hide a broken install step."""
    path = shutil.which(name, path=SBIN)
    if path is None:
        reason = f"{name} is not installed (apt-get install {package}, or `make system-deps`)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    """A scratch directory that daemons dropping root (nginx workers, PgBouncer) can reach:
    pytest's tmp_path may sit below a mode-700 directory."""
    path = Path(tempfile.mkdtemp(prefix=f"turnstore-{prefix}-")).resolve()
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def wait_until(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


# --- processes ---------------------------------------------------------------------------


@dataclass
class Process:
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    async def wait(self, timeout_s: float) -> int:
        """The exit status, polling (the event loop goes on serving meanwhile)."""
        await wait_until(lambda: _exited(self.popen), f"{self.popen.args!r} to exit", timeout_s)
        return self.popen.returncode


async def _exited(popen: subprocess.Popen[bytes]) -> bool:
    return popen.poll() is not None


def stop(popen: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


@contextmanager
def process(
    args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO
) -> Iterator[Process]:
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
        )
    try:
        yield Process(popen, log)
    finally:
        stop(popen)


def turnstore_env(**settings: str) -> dict[str, str]:
    """A clean environment: nothing of the developer's turnstore settings leaks in."""
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR") if key in os.environ}
    # PYTHONPATH: this checkout's code, also when the venv's editable install points elsewhere.
    return {**env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **settings}


@dataclass
class Replica:
    url: str
    process: Process


@contextmanager
def replica(env: dict[str, str], log: Path, *args: str) -> Iterator[Replica]:
    port = free_port()
    serve = [TURNSTORE, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with process(serve, log, env) as proc:
        yield Replica(f"http://127.0.0.1:{port}", proc)


async def wait_ready(replica: Replica, status: int = 200, timeout_s: float = 60.0) -> None:
    """Until /readyz answers ``status``; fails at once (with the log) if the process died."""

    async def ready() -> bool:
        if replica.process.popen.poll() is not None:
            raise AssertionError(f"{replica.url} exited:\n{replica.process.tail()}")
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(f"{replica.url}/readyz")).status_code == status
        except httpx.TransportError:
            return False

    await wait_until(ready, f"{replica.url}/readyz to answer {status}", timeout_s)


# --- the fake Responses API over HTTP ------------------------------------------------------


async def read_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class FakeAPIApp:
    """tests/support/fakeapi.py's FakeResponsesAPI as an ASGI app, so replicas in other processes
    call it over HTTP and this process sees every request. ``delay_s`` holds each answer back
    a little, so that turns overlap. A client that hangs up closes the upstream response (and
    so sets its script's ``closed``)."""

    def __init__(self, api: FakeResponsesAPI, delay_s: float = 0.0) -> None:
        self.api = api
        self.delay_s = delay_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = await read_body(receive)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        request = httpx.Request(
            scope["method"], f"http://fake.invalid{scope['path']}", headers=headers, content=body
        )
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        response = await self.api.handle(request)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": response.headers.raw,
                }
            )
            relay = asyncio.ensure_future(self._relay(response, send))
            hangup = asyncio.ensure_future(self._hangup(receive))
            await asyncio.wait({relay, hangup}, return_when=asyncio.FIRST_COMPLETED)
            for task in (relay, hangup):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        finally:
            await response.aclose()

    @staticmethod
    async def _relay(response: httpx.Response, send: Any) -> None:
        async for chunk in response.aiter_bytes():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _hangup(receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


@asynccontextmanager
async def fake_api(api: FakeResponsesAPI, delay_s: float = 0.0) -> AsyncIterator[str]:
    """Serve ``api`` on a loopback port in this event loop; yields OPENAI_BASE_URL."""
    app = FakeAPIApp(api, delay_s)
    # Keep-alive longer than any test: no keep-alive race with the replicas.
    async with serve(
        app, lifespan="off", timeout_graceful_shutdown=2, timeout_keep_alive=30
    ) as url:
        yield f"{url}/v1"


def provider_env(base_url: str) -> dict[str, str]:
    return {
        "LLM_PROVIDER": "openai",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "sk-test",
        "OPENAI_MODEL": "gpt-test",
    }


# --- nginx ---------------------------------------------------------------------------------

NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream turnstore {{
{servers}
        keepalive 32;
        keepalive_timeout 4s;  # below uvicorn's 5 s: nginx never reuses a closing connection
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://turnstore;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


@contextmanager
def nginx(upstreams: list[str]) -> Iterator[str]:
    """nginx round robin over ``upstreams`` (http://host:port), as deploy/nginx.conf does it:
    HTTP/1.1 keep-alive to the replicas, no response buffering (SSE)."""
    binary = system_tool("nginx", "nginx-light")
    with workdir("nginx") as path:
        port = free_port()
        servers = "\n".join(f"        server {url.removeprefix('http://')};" for url in upstreams)
        conf = path / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=path, servers=servers, port=port))
        args = [binary, "-p", str(path), "-c", str(conf), "-e", str(path / "error.log")]
        with process(args, path / "stdout.log") as proc:
            _wait_for_port(port, proc)
            yield f"http://127.0.0.1:{port}"


def _wait_for_port(port: int, proc: Process, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.popen.poll() is not None:
            raise AssertionError(f"{proc.popen.args[0]} exited:\n{proc.tail()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on port {port}:\n{proc.tail()}")
        time.sleep(0.02)


# --- PgBouncer -----------------------------------------------------------------------------

PGBOUNCER_INI = """\
[databases]
{database} = host={host} port={port} dbname={database} user={user} {password}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 500
logfile = {dir}/pgbouncer.log
"""


@contextmanager
def pgbouncer(database_url: str, pool_size: int = 4, port: int | None = None) -> Iterator[str]:
    """PgBouncer in transaction pooling mode in front of ``database_url``'s database; yields
    the URL to reach that database through it. ``pool_size`` server connections are shared by
    all clients, so consecutive transactions of one client land on different ones."""
    binary = system_tool("pgbouncer", "pgbouncer")
    url = make_url(database_url)
    with workdir("pgbouncer") as path:
        listen_port = port or free_port()
        password = f"password={url.password}" if url.password else ""
        ini = path / "pgbouncer.ini"
        settings = {
            "database": url.database, "host": url.host or "127.0.0.1", "port": url.port or 5432,
            "user": url.username, "password": password, "listen_port": listen_port, "dir": path,
            "pool_size": pool_size,
        }  # fmt: skip
        ini.write_text(PGBOUNCER_INI.format(**settings))
        (path / "userlist.txt").write_text(f'"{url.username}" ""\n')
        args = [binary, str(ini)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            user = _unprivileged_user()
            for file in (path, *path.iterdir()):
                os.chown(file, user.pw_uid, user.pw_gid)
            args[1:1] = ["-u", user.pw_name]
        with process(args, path / "stdout.log") as proc:
            _wait_for_port(listen_port, proc)
            yield url.set(host="127.0.0.1", port=listen_port).render_as_string(hide_password=False)


def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "turnstore-pg", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise AssertionError("no unprivileged user to run PgBouncer as")


class Served(NamedTuple):
    replica: Replica
    client: httpx.AsyncClient


@asynccontextmanager
async def served(env: dict[str, str], tmp_path: Path, *names: str) -> AsyncIterator[list[Served]]:
    """A replica with ``env`` for each name (its log ``tmp_path/<name>.log``), all ready, each
    with a client: ``async with served(env, tmp_path, "a", "b") as ((a, one), (b, two))``."""
    with ExitStack() as stack:
        started = [stack.enter_context(replica(env, tmp_path / f"{name}.log")) for name in names]
        await asyncio.gather(*(wait_ready(r) for r in started))
        async with AsyncExitStack() as clients:
            yield [
                Served(
                    r,
                    await clients.enter_async_context(
                        httpx.AsyncClient(base_url=r.url, timeout=60)
                    ),
                )
                for r in started
            ]


@asynccontextmanager
async def replicas(
    database: str, tmp_path: Path, api: FakeResponsesAPI, count: int = 2, **settings: str
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """``count`` replicas on ``database`` calling ``api``; a client for each."""
    async with fake_api(api) as base_url:
        env = turnstore_env(DATABASE_URL=database, **provider_env(base_url), **settings)
        names = [f"replica-{n}" for n in range(count)]
        async with served(env, tmp_path, *names) as started:
            yield [each.client for each in started]
