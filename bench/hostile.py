"""Part 4, hostile input: what the worst 1 MiB request bodies cost a real `turnstore serve`.

Each body is sent REPEAT times to POST /api/v1/chat; the figure is the server process's CPU
time (user + system, from psutil) per request. Every body must be refused (4xx).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.database import sqlalchemy_url
from bench.http import Connection
from bench.server import free_port, running, turnstore_command

MiB = 1024 * 1024
REPEAT = 20
CHAT = "/api/v1/chat"


def _fill(head: bytes, unit: bytes, tail: bytes) -> bytes:
    """``head + unit * n + tail`` as close to 1 MiB as the body limit allows."""
    room = MiB - len(head) - len(tail) - 64
    return head + unit * (room // len(unit)) + tail


BODIES: dict[str, bytes] = {
    "[[],[],...] (the old worst case)": _fill(b"[", b"[],", b"[]]"),
    "message: [{},{},...]": _fill(b'{"message": [', b"{},", b"{}]}"),
    "an unknown key holding [[[...]]]": _fill(b'{"message": "x", "x": ', b"[", b""),
    "message: 1 MiB of \\u escapes": _fill(b'{"message": "', b"\\u00e9", b'"}'),
    "the key message, repeated": _fill(b'{"message": "x"', b', "message": "x"', b"}"),
    "1 MiB of nested objects": _fill(b"", b'{"a":', b""),
    "a valid flat body, 1 MiB of text": json.dumps({"message": "x" * (MiB - 64)}).encode(),
}


@dataclass
class HostileResult:
    cpu_ms: dict[str, float]  # per request, by body
    statuses: dict[str, set[int]]


async def _send(port: int, body: bytes) -> int:
    conn = Connection(port)
    try:
        status, _ = await conn.request("POST", CHAT, body)
        return status
    finally:
        await conn.close()


def run(url: str, logs: Path) -> HostileResult:
    port = free_port()
    env = {"DATABASE_URL": sqlalchemy_url(url), "LOG_FORMAT": "text"}
    command = [*turnstore_command(), "serve", "--port", str(port)]
    cpu: dict[str, float] = {}
    statuses: dict[str, set[int]] = {}
    with running(command, port, env, logs / "hostile.log") as pid:
        server = psutil.Process(pid)
        for label, body in BODIES.items():
            asyncio.run(_send(port, body))  # warm: the first request of a kind costs more
            before = server.cpu_times()
            seen = {asyncio.run(_send(port, body)) for _ in range(REPEAT)}
            after = server.cpu_times()
            spent = (after.user - before.user) + (after.system - before.system)
            cpu[label] = spent / REPEAT * 1000
            statuses[label] = seen
    return HostileResult(cpu, statuses)


def lines(result: HostileResult) -> list[str]:
    out = [f"{'body (about 1 MiB)':<40} {'server CPU per request':>24}  answers"]
    for label, ms in result.cpu_ms.items():
        answers = ",".join(map(str, sorted(result.statuses[label])))
        out.append(f"{label:<40} {ms:>21.1f} ms  {answers}")
    return out
