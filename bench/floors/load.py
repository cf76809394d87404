"""The floors part's load: the same turns for every subject, over the lean client
(bench/http.py), each answer checked (revision, reply text, SSE events), so a subject that
skipped its work could not pass. Three kinds of turn:

- ``/api/v1``: POST /api/v1/chat, the first turn of each conversation making it;
- ``stream``: POST /api/v1/chat/stream on a kept-alive connection, read to message.done;
- ``/v1``: POST /v1/responses on a conversation made before (POST /v1/conversations)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.http import Connection
from bench.workload import payload

KINDS = ("/api/v1", "stream", "/v1")


def expected_reply(message: str, history: int) -> str:
    """The fake provider's answer after ``history`` earlier turns."""
    return f"[fake-llm] {message}" + (f" (history={2 * history})" if history else "")


def _events(body: bytes) -> list[dict[str, str]]:
    blocks = body.replace(b"\r\n", b"\n").decode().split("\n\n")
    return [
        dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        for block in blocks
        if block.strip() and not block.startswith(":")
    ]


async def _plain(conn: Connection, message: str, history: int, cid: str | None) -> str:
    body = json.dumps({"message": message, "conversation_id": cid}).encode()
    status, answer = await conn.request("POST", "/api/v1/chat", body)
    done = json.loads(answer) if status == 200 else {}
    if done.get("revision") != history + 1 or done.get("message") != expected_reply(
        message, history
    ):
        raise RuntimeError(f"/api/v1 turn failed: {status} {answer[:300]!r}")
    return str(done["conversation_id"])


async def _stream(conn: Connection, message: str, history: int, cid: str | None) -> str:
    body = json.dumps({"message": message, "conversation_id": cid}).encode()
    status, answer = await conn.request("POST", "/api/v1/chat/stream", body)
    events = _events(answer) if status == 200 else []
    deltas = "".join(json.loads(e["data"])["delta"] for e in events[:-1])
    done = (
        json.loads(events[-1]["data"]) if events and events[-1]["event"] == "message.done" else {}
    )
    if done.get("revision") != history + 1 or deltas != expected_reply(message, history):
        raise RuntimeError(f"streamed turn failed: {status} {answer[:300]!r}")
    return str(done["conversation_id"])


async def _v1(conn: Connection, message: str, history: int, cid: str | None) -> str:
    assert cid is not None  # made before the turns
    body = json.dumps({"input": message, "conversation": cid}).encode()
    status, answer = await conn.request("POST", "/v1/responses", body)
    response = json.loads(answer) if status == 200 else {}
    text = response.get("output", [{}])[-1].get("content", [{}])[0].get("text")
    if response.get("id") != f"resp_{cid[5:]}{history + 1:08x}" or text != expected_reply(
        message, history
    ):
        raise RuntimeError(f"/v1 turn failed: {status} {answer[:300]!r}")
    return cid


TURN: dict[str, Callable[[Connection, str, int, str | None], Awaitable[str]]] = {
    "/api/v1": _plain,
    "stream": _stream,
    "/v1": _v1,
}


@dataclass
class Loaded:
    turns: int
    seconds: float
    conversations: dict[int, str] = field(default_factory=dict)  # workload number -> id


async def _conversations(port: int, count: int) -> list[str]:
    conn = Connection(port)
    try:
        made = []
        for _ in range(count):
            status, body = await conn.request("POST", "/v1/conversations", b"{}")
            if status != 200:
                raise RuntimeError(f"POST /v1/conversations failed: {status} {body[:200]!r}")
            made.append(str(json.loads(body)["id"]))
        return made
    finally:
        await conn.close()


async def prepare(kind: str, port: int, conversations: int) -> list[str | None]:
    """What each conversation starts from: nothing, or (/v1) a conversation made now."""
    if kind == "/v1":
        return list(await _conversations(port, conversations))
    return [None] * conversations


async def run(
    kind: str, port: int, starts: list[str | None], turns: int, concurrency: int
) -> Loaded:
    """``turns`` turns of each conversation, ``concurrency`` conversations at a time."""
    turn = TURN[kind]
    messages = [[payload(n, h).user_text for h in range(turns)] for n in range(len(starts))]
    waiting = list(range(len(starts)))
    loaded = Loaded(len(starts) * turns, 0.0)

    async def worker() -> None:
        conn = Connection(port)
        try:
            while waiting:
                n = waiting.pop()
                cid = starts[n]
                for history in range(turns):
                    cid = await turn(conn, messages[n][history], history, cid)
                loaded.conversations[n] = str(cid)
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    loaded.seconds = time.perf_counter() - start
    return loaded
