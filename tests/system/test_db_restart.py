"""Fast restarts of PostgreSQL under load (issue 28): two real `turnstore serve` replicas on a
private server (tests/support/pgserver.py), restarted three times (``pg_ctl restart -m fast``; ``-m
immediate``, which adds crash recovery; and a start that takes a while, the server answering
57P03 "starting up" meanwhile) while clients send plain, streamed and ``/v1`` streamed turns
to shared conversations and poll ``/readyz``.

What must hold (the contract's "What commits": a database failure of any kind is
``storage_error`` on every surface and in every background task, and leaves the conversation
free for its next turn at once):

- every answer is a success, ``500 storage_error`` (for a stream: its ``error`` event), or,
  from ``/readyz``, ``503 not_ready``: never ``internal_error``, never anything else;
- every stream, on either surface, ends with exactly one terminal event;
- once the server is back, the next turn on each conversation succeeds on each replica (no
  ``409 conversation_busy``: the in-process lock and the lease were let go);
- the background loops survived: a streamed turn held in the provider across the restart,
  longer than a third of ``TURN_LEASE_S`` after it, has its lease and its run's heartbeat
  renewed, and commits;
- neither replica logged a traceback.

The report gives, for each restart, the answers seen from the restart until each replica
served again (counts by surface, status and code) and each replica's recovery time: from the
server accepting connections again to that replica's first success.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.cluster import (
    TURNSTORE,
    FakeAPIApp,
    Replica,
    process,
    provider_env,
    replica,
    turnstore_env,
    wait_ready,
    wait_until,
)
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import CHAT, TURN_KINDS, error_code, serve, turn_outcome, until_renewed
from tests.support.pgserver import PrivatePostgres, private_postgres, until_refused

REPLICAS = 2
CONVERSATIONS = 3  # each has a client on each replica: the replicas race for it
READYZ_POLLERS = 2  # per replica
PROVIDER_DELAY_S = 0.02  # turns overlap, so a restart finds some in flight
BEFORE = 20  # successes before a restart
AFTER = 4  # successes per replica after it before the next step
BACKOFF_S = 0.05  # a client's pause after a failure (a client does not retry in a busy loop)
LEASE_S = 3.0  # TURN_LEASE_S: renewals every second
QUEUE_WAIT_S = 10.0  # TURN_QUEUE_WAIT_S: a turn behind a lock nobody lets go gets 409 then
TIMEOUT_S = 30.0  # any single wait
HOLD = "hold this turn across the restart"
REPORT: list[str] = []


@dataclass(frozen=True)
class Answer:
    replica: int
    kind: str  # chat | stream | v1 | readyz | "next <kind>" (a turn after a restart)
    started: float
    finished: float
    status: int  # HTTP status (a stream's: its response's)
    code: str  # "ok", the error code, or what went wrong

    @property
    def ok(self) -> bool:
        return self.code == "ok"

    @property
    def allowed(self) -> bool:
        if self.kind == "readyz":
            return (self.status, self.code) in {(200, "ok"), (503, "not_ready")}
        # A stream's error event comes after its 200.
        return self.ok or (self.code == "storage_error" and self.status in (200, 500))


class HoldingAPI(FakeAPIApp):
    """The fake Responses API, holding back a request that carries ``HOLD`` until ``release``
    is set (``held`` is set once it arrived)."""

    def __init__(self, api: FakeResponsesAPI, delay_s: float) -> None:
        super().__init__(api, delay_s)
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        messages: list[dict[str, Any]] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        if HOLD.encode() in b"".join(m.get("body", b"") for m in messages):
            self.held.set()
            await self.release.wait()
        replay = iter(messages)

        async def replayed() -> dict[str, Any]:
            return next(replay, None) or await receive()

        await super().__call__(scope, replayed, send)


@dataclass
class Load:
    """The clients, sending turns one after the other until ``stop``, and the /readyz
    pollers; every answer recorded."""

    clients: list[httpx.AsyncClient]  # one per replica
    ids: list[str]
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def successes(self, replica: int, since: float) -> int:
        return sum(
            a.ok and a.replica == replica and a.kind != "readyz" and a.started > since
            for a in self.answers
        )

    async def record(self, replica: int, kind: str, call: Callable[[], Any]) -> Answer:
        started = time.monotonic()
        try:
            status, code = await call()
        except httpx.TransportError as error:
            status, code = 0, f"transport {type(error).__name__}"
        answer = Answer(replica, kind, started, time.monotonic(), status, code)
        self.answers.append(answer)
        return answer

    async def client(self, replica: int, conversation: int) -> None:
        client, cid = self.clients[replica], self.ids[conversation]
        turn = 0
        while not self.stop.is_set():
            kind = TURN_KINDS[turn % len(TURN_KINDS)]
            turn += 1
            message = f"{kind} {replica}/{conversation}/{turn}"
            answer = await self.record(
                replica, kind, functools.partial(turn_outcome, client, cid, kind, message)
            )
            if not answer.ok:
                await asyncio.sleep(BACKOFF_S)

    async def readyz(self, replica: int) -> None:
        async def ask() -> tuple[int, str]:
            response = await self.clients[replica].get("/readyz")
            return response.status_code, "ok" if response.status_code == 200 else error_code(
                response
            )

        while not self.stop.is_set():
            await self.record(replica, "readyz", ask)
            await asyncio.sleep(0.02)


@asynccontextmanager
async def _cluster(
    server: PrivatePostgres, tmp_path: Path, api: HoldingAPI
) -> AsyncIterator[list[Replica]]:
    """Two replicas on the server, migrated by `turnstore db upgrade`, calling ``api``."""
    async with serve(
        api, lifespan="off", timeout_graceful_shutdown=2, timeout_keep_alive=30
    ) as url:
        env = turnstore_env(
            DATABASE_URL=server.url, DB_POOL_SIZE="4", TURN_LEASE_S=str(LEASE_S),
            TURN_QUEUE_WAIT_S=str(QUEUE_WAIT_S), **provider_env(f"{url}/v1"),
        )  # fmt: skip
        with process([TURNSTORE, "db", "upgrade"], tmp_path / "upgrade.log", env) as upgrade:
            assert await upgrade.wait(60) == 0, upgrade.tail()
        with ExitStack() as stack:
            replicas = [
                stack.enter_context(replica(env, tmp_path / f"replica-{i}.log"))
                for i in range(REPLICAS)
            ]
            await asyncio.gather(*(wait_ready(r) for r in replicas))
            try:
                yield replicas
            except BaseException:
                for r in replicas:
                    print(f"--- {r.url}\n{r.process.tail(80)}")
                raise


async def test_restarts_under_load_are_storage_error_and_leave_nothing_stuck(
    tmp_path: Path,
) -> None:
    with private_postgres() as server:
        api = HoldingAPI(FakeResponsesAPI(), PROVIDER_DELAY_S)
        async with _cluster(server, tmp_path, api) as replicas:
            clients = [httpx.AsyncClient(base_url=r.url, timeout=TIMEOUT_S) for r in replicas]
            try:
                ids = [await _create(clients[n % REPLICAS]) for n in range(CONVERSATIONS)]
                load = Load(clients, ids)
                tasks = [
                    asyncio.create_task(load.client(r, c))
                    for r in range(REPLICAS)
                    for c in range(CONVERSATIONS)
                ] + [
                    asyncio.create_task(load.readyz(r))
                    for r in range(REPLICAS)
                    for _ in range(READYZ_POLLERS)
                ]
                try:
                    for mode in ("fast", "immediate", "slow start"):
                        await _restart(server, mode, api, load)
                finally:
                    load.stop.set()
                    done, pending = await asyncio.wait(tasks, timeout=TIMEOUT_S)
                    for task in pending:
                        task.cancel()
                    REPORT.append(_outcome(load.answers, replicas))
                for task in done:
                    task.result()
                assert not pending, "clients did not stop"
            finally:
                for client in clients:
                    await client.aclose()
            unexpected = Counter((a.kind, a.status, a.code) for a in load.answers if not a.allowed)
            assert not unexpected, unexpected
            for r in replicas:
                assert "Traceback" not in r.process.log.read_text(errors="replace"), r.url


async def _restart(server: PrivatePostgres, mode: str, api: HoldingAPI, load: Load) -> None:
    """One restart under the load, a streamed turn held in the provider across it; then that
    turn's renewals, and the next turn of every conversation on every replica."""
    clients = load.clients
    api.held, api.release = asyncio.Event(), asyncio.Event()
    held_cid = await _create(clients[0])
    held = asyncio.create_task(turn_outcome(clients[0], held_cid, "stream", HOLD))
    await asyncio.wait_for(api.held.wait(), TIMEOUT_S)
    mark = time.monotonic()
    await _until(lambda: sum(load.successes(r, mark) for r in range(REPLICAS)) >= BEFORE, "load")

    restarting = time.monotonic()
    if mode == "slow start":
        await _slow_start(server, load)
    else:
        await asyncio.to_thread(server.restart, mode)
    accepting = time.monotonic()  # pg_ctl -w returned: the server accepts connections
    await _until(
        lambda: all(load.successes(r, accepting) >= AFTER for r in range(REPLICAS)),
        f"{AFTER} successes per replica after the restart",
    )
    served = time.monotonic()
    REPORT.extend(_report(mode, load.answers, restarting, accepting, served))

    # The held turn's lease and its run's heartbeat are renewed after the restart (the loops
    # that renew them survived it), and the turn commits.
    await until_renewed(server.dsn, held_cid, accepting, LEASE_S)
    api.release.set()
    assert await asyncio.wait_for(held, TIMEOUT_S) == (200, "ok")

    # The next turn of each conversation, of each kind, on each replica, one after the other
    # (the load goes on meanwhile: each may queue behind a turn of it).
    nexted = []
    for r, client in enumerate(clients):
        for cid in [*load.ids, held_cid]:
            for kind in TURN_KINDS:
                turn = functools.partial(turn_outcome, client, cid, kind, "next")
                nexted.append(await load.record(r, f"next {kind}", turn))
    took = sorted(a.finished - a.started for a in nexted)
    REPORT.append(
        f"  next turns after it: {len(nexted)}, {sum(a.ok for a in nexted)} of them 200, median "
        f"{took[len(took) // 2]:.3f} s, slowest {took[-1]:.3f} s"
    )
    assert all(a.ok for a in nexted), [a for a in nexted if not a.ok]


async def _slow_start(server: PrivatePostgres, load: Load) -> None:
    """A restart whose start takes a while (crash recovery of a large database): stopped, then
    starting up, answering every connection 57P03, until each replica has answered a turn and
    a /readyz meanwhile, and for longer than a renewal interval (``LEASE_S / 3``: the loops
    that renew leases, places and heartbeats each meet it once at least); then up."""
    await asyncio.to_thread(server.stop, "fast")
    await asyncio.to_thread(server.start_standby, hot=False)
    await until_refused(server, "57P03")
    since = time.monotonic()

    def answered() -> bool:
        return all(
            any(a.replica == r and a.kind == kind and a.started > since for a in load.answers)
            for r in range(REPLICAS)
            for kind in ("chat", "readyz")
        )

    await _until(answered, "each replica to answer while the server starts up")
    await asyncio.sleep(max(0.0, 1.5 * LEASE_S / 3 - (time.monotonic() - since)))
    await asyncio.to_thread(server.stop, "fast")
    await asyncio.to_thread(server.start)


async def _create(client: httpx.AsyncClient) -> str:
    response = await client.post(CHAT, json={"message": "created"})
    assert response.status_code == 200, response.text
    return str(response.json()["conversation_id"])


def _report(
    mode: str,
    answers: list[Answer],
    restarting: float,
    accepting: float,
    served: float,
) -> list[str]:
    around = [
        a for a in answers if restarting <= a.finished <= served and not a.kind.startswith("next")
    ]
    counts = Counter((a.kind, a.status, a.code) for a in around)
    lines = [
        f"restart ({mode}): stop and start {accepting - restarting:.3f} s; answers from the "
        "restart until both replicas served again: "
        + ", ".join(f"{n} {k} {s} {c}" for (k, s, c), n in sorted(counts.items()))
    ]
    for r in range(REPLICAS):
        mine = [a for a in answers if a.replica == r and a.ok and a.started > accepting]
        first_turn = min(a.finished for a in mine if a.kind in TURN_KINDS)
        first_ready = min((a.finished for a in mine if a.kind == "readyz"), default=float("nan"))
        lines.append(
            f"  replica {r}: first turn 200 {first_turn - accepting:.3f} s, first /readyz 200 "
            f"{first_ready - accepting:.3f} s after the server accepted connections again"
        )
    return lines


def _outcome(answers: list[Answer], replicas: list[Replica]) -> str:
    """What was wrong in the whole run, and what the replicas logged."""
    wrong = Counter((a.kind, a.status, a.code) for a in answers if not a.allowed)
    said = "; ".join(f"replica {n}: {_causes(r)}" for n, r in enumerate(replicas))
    return (
        f"{len(answers)} answers in all, {sum(wrong.values())} not allowed"
        + "".join(f", {n} {k} {s} {c}" for (k, s, c), n in sorted(wrong.items()))
        + f"; logged: {said}"
    )


def _causes(replica: Replica) -> str:
    """What the replica logged: its 5xx by cause (class and SQLSTATE), unhandled errors and
    tracebacks."""
    text = replica.process.log.read_text(errors="replace")
    causes: Counter[str] = Counter()
    for match in re.finditer(r"(storage_error|internal_error): (\w+) sqlstate=(\w+)", text):
        causes[f"{match[1]} {match[2]}/{match[3]}"] += 1
    causes["unhandled error"] = text.count("unhandled error")
    causes["Traceback"] = text.count("Traceback")
    return ", ".join(f"{n} {cause}" for cause, n in causes.most_common() if n) or "nothing"


async def _until(check: Callable[[], bool], what: str) -> None:
    async def checked() -> bool:
        return check()

    await wait_until(checked, what, TIMEOUT_S)
