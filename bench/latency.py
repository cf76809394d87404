"""Part 16, latency added: what turnstore adds to a streamed turn before its provider's request
starts, and to each delta on its way from the provider to the client, at 1 and at 200 turns
of history, on /api/v1 and on /v1.

A `turnstore serve` process (LLM_PROVIDER=openai) calls the fake Responses API of the tests
(tests/support/fakeapi.py), served over HTTP from this process (bench/upstream.py), which
streams each reply as ``DELTAS`` text deltas ``DRIP_S`` apart. One clock for every process
(``time.monotonic``, the machine's):

- before the provider: from the request's arrival at turnstore's application to the fake
  receiving turnstore's request (the plan, the lease, the window read, the provider request's
  encoding and its way over loopback). The server is `turnstore serve`'s application and
  uvicorn options, wrapped to keep each request's arrival (bench/arrivals.py). Printed beside
  it, from just before the client sends: that and the client's own send and one more loopback
  hop, an upper bound;
- per delta: from the fake sending a delta to the client having read it (two loopback hops
  and the client's SSE parsing included). A client event that carries several deltas counts
  each from its own sending.

``SAMPLES`` turns per surface and history; p50 and p99 of each. Targets: p50 at most 2 ms
before the provider (from the arrival) and at most 1 ms per delta. Also counted: the
connections turnstore opened to the provider (one for every turn, kept alive).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import arrivals
from bench.database import sqlalchemy_url
from bench.server import free_port, running
from bench.upstream import Served
from tests.support.fakeapi import FakeResponsesAPI, Script

HISTORIES = (1, 200)
SURFACES = ("/api/v1", "/v1")
SAMPLES = 40
DELTAS, DRIP_S = 8, 0.005
PIECE = 8  # characters a delta: the fake cuts its text into DELTAS equal pieces
TEXT = "".join(chr(ord("a") + n) * PIECE for n in range(DELTAS))
MODEL = "gpt-bench"
TARGET_BEFORE_MS, TARGET_DELTA_MS = 2.0, 1.0


@dataclass
class Added:
    surface: str
    history: int
    streamed: bool
    delta_s: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    provider_at: list[float] = field(default_factory=list)
    arrival_s: list[float] = field(default_factory=list)  # from the arrival at turnstore

    @property
    def before_s(self) -> list[float]:
        """Each turn's time before the provider from the client's send."""
        return [at - sent for sent, at in zip(self.sent, self.provider_at, strict=True)]

    def arrived(self, times: list[float]) -> None:
        """Each turn's time before the provider from its arrival at turnstore: the one
        arrival between the client's send and the provider's receiving (the client sends
        one request at a time)."""
        for sent, provider_at in zip(self.sent, self.provider_at, strict=True):
            (arrival,) = [t for t in times if sent <= t <= provider_at]
            self.arrival_s.append(provider_at - arrival)


@dataclass
class Measured:
    added: list[Added]
    connections: int  # turnstore's to the provider
    requests: int  # the provider's


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def _request(surface: str, conversation: str | None, text: str, stream: bool) -> dict[str, object]:
    if surface == "/api/v1":
        body: dict[str, object] = {"message": text}
        if conversation is not None:
            body["conversation_id"] = conversation
        return body
    body = {"model": MODEL, "input": text, "stream": stream}
    if conversation is not None:
        body["conversation"] = conversation
    return body


def _path(surface: str, stream: bool) -> str:
    if surface == "/api/v1":
        return "/api/v1/chat/stream" if stream else "/api/v1/chat"
    return "/v1/responses"


async def _history(client: httpx.AsyncClient, surface: str, turns: int) -> str:
    """A conversation of ``turns`` turns (answered at once), its id as ``surface`` names it."""
    if surface == "/api/v1":
        made = await client.post("/api/v1/chat", json=_request(surface, None, "turn 1", False))
        made.raise_for_status()
        conversation: str = made.json()["conversation_id"]
        done = 1
    else:
        created = await client.post("/v1/conversations", json={})
        created.raise_for_status()
        conversation, done = created.json()["id"], 0
    for n in range(done + 1, turns + 1):
        body = _request(surface, conversation, f"turn {n}", False)
        answered = await client.post(_path(surface, False), json=body)
        answered.raise_for_status()
    return conversation


async def _turn(
    client: httpx.AsyncClient, api: FakeResponsesAPI, served: Served, added: Added, cid: str
) -> None:
    """One turn: when its provider request started, and (streamed) each delta's way."""
    script = Script(text=TEXT, deltas=DELTAS, drip_s=DRIP_S)
    api.then(script)
    arrived = len(served.arrivals)
    body = _request(added.surface, cid, "and one more question", added.streamed)
    path = _path(added.surface, added.streamed)
    wanted = "message.delta" if added.surface == "/api/v1" else "response.output_text.delta"
    event, received, counted = "", 0, 0
    sent = time.monotonic()
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == wanted:
                now = time.monotonic()
                received += len(json.loads(line[5:])["delta"])
                while counted < DELTAS and received >= PIECE * (counted + 1):
                    added.delta_s.append(now - script.sent[counted])
                    counted += 1
    if added.streamed and counted != DELTAS:
        raise RuntimeError(f"{added.surface}: {counted} of {DELTAS} deltas reached the client")
    added.sent.append(sent)
    added.provider_at.append(served.arrivals[arrived])


async def _measure(port: int, api: FakeResponsesAPI, served: Served) -> list[Added]:
    results = []
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for surface in SURFACES:
            for history in HISTORIES:
                cid = await _history(client, surface, history)
                for streamed in (False, True):
                    added = Added(surface, history, streamed)
                    for _ in range(SAMPLES):
                        await _turn(client, api, served, added, cid)
                    results.append(added)
        times = (await client.get(arrivals.PATH)).raise_for_status().json()
    for added in results:
        added.arrived(times)
    return results


def run(url: str, log_dir: Path) -> Measured:
    api = FakeResponsesAPI()
    with Served(api) as served:
        port = free_port()
        env = {
            "DATABASE_URL": sqlalchemy_url(url),
            "LLM_PROVIDER": "openai",
            "OPENAI_BASE_URL": f"{served.url}/v1",
            "OPENAI_API_KEY": "sk-bench",
            "OPENAI_MODEL": MODEL,
        }
        command = [sys.executable, "-m", "bench.arrivals", "--port", str(port)]
        with running(command, port, env, log_dir / "latency.log"):
            added = asyncio.run(_measure(port, api, served))
        return Measured(added, len(served.connections), len(served.arrivals))


def _ms(values: list[float]) -> str:
    ms = [s * 1000 for s in values]
    return f"p50 {_percentile(ms, 0.5):5.2f} ms, p99 {_percentile(ms, 0.99):5.2f} ms"


def lines(measured: Measured) -> Iterator[str]:
    results = measured.added
    for added in results:
        line = (
            f"{added.surface:8} {'streamed' if added.streamed else 'plain':8} "
            f"{added.history:3} turns of history: before the provider {_ms(added.arrival_s)} "
            f"(from the client's send {_ms(added.before_s)})"
        )
        if added.delta_s:
            line += f"; a delta {_ms(added.delta_s)}"
        yield line
    yield (
        f"turnstore's connections to the provider: {measured.connections} "
        f"for {measured.requests} requests"
    )
    worst_before = max(_percentile(a.arrival_s, 0.5) for a in results) * 1000
    worst_delta = max(_percentile(a.delta_s, 0.5) for a in results if a.delta_s) * 1000
    yield (
        f"worst p50: {worst_before:.2f} ms before the provider (target <= {TARGET_BEFORE_MS} ms), "
        f"{worst_delta:.2f} ms a delta (target <= {TARGET_DELTA_MS} ms)"
    )
