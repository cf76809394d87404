"""Every kind of turn, served by one in-process replica, with what each cost the database: its
round trips (every statement the replica's pool sent, counted by asyncpg's query logger) and
the two-phase commits the Citus coordinator made for it (``pg_dist_transaction``; the test
cluster never recovers them, so none is forgotten meanwhile: tests/support/citus.py).

Each turn is held by its provider for ``HELD_S``, longer than a third of ``TURN_LEASE_S``:
its lease, its place among its owner's running turns, its run's heartbeat and its
Idempotency-Key claim are renewed while it runs, as those of a reasoning model's turns are
(the measure counts the renewals, so a kind that renewed nothing is seen).
Used by tests/system/test_citus_turn_kinds.py and ``make bench`` part 12.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import asyncpg
import httpx
from sqlalchemy import event

from service.app import create_app, postgres_backend, postgres_store
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.store.cache import CachedStore
from tests.support.database import asyncpg_dsn
from tests.support.events import STREAM, TURNS, background, event_names, follow
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, TLS, serve

LEASE_S = 1.0  # TURN_LEASE_S: renewed every third of it
HELD_S = 1.0  # each provider call: two or three renewals
RENEWALS = (
    "owner_turns SET until",
    "heartbeat_until = now()",
    "lease_expires_at = CAST",
    "idempotency_keys SET expires_at = CAST",
)


@dataclass(frozen=True)
class Cost:
    round_trips: int
    two_phase: int | None  # None: not a Citus coordinator
    renewals: int  # statements among the round trips that renewed something held


class _Log:
    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, record: Any) -> None:
        self.queries.append(record.query)


class Replica:
    """One replica of the app over a counted pool, its client, and its provider."""

    def __init__(
        self, url: str, client: httpx.AsyncClient, api: FakeResponsesAPI, log: _Log, held_s: float
    ) -> None:
        self.url, self.client, self.api, self.log = url, client, api, log
        self.held_s = held_s

    def held(self, **script: Any) -> Script:
        """The provider's next answer, given after ``held_s`` (a gate opened by the clock)."""
        gate = asyncio.Event()
        asyncio.get_running_loop().call_later(self.held_s, gate.set)
        answer = Script(gate=gate, **script)
        self.api.then(answer)
        return answer

    def renewals(self) -> int:
        return sum(1 for q in self.log.queries if any(mark in q for mark in RENEWALS))

    async def renewed(self, since: int, timeout_s: float = 10) -> None:
        """Until something held was renewed after ``since`` renewals (when turns are held)."""
        deadline = time.monotonic() + timeout_s
        while self.held_s and self.renewals() <= since:
            assert time.monotonic() < deadline, "nothing was renewed"
            await asyncio.sleep(0.02)

    async def measure(self, kind: Callable[[Replica], Awaitable[None]]) -> Cost:
        conn = await asyncpg.connect(asyncpg_dsn(self.url))
        try:
            await _settled(conn)
            before_2pc, before = await _two_phase(conn), len(self.log.queries)
            await kind(self)
            await _settled(conn)
            after_2pc = await _two_phase(conn)
        finally:
            await conn.close()
        sent = self.log.queries[before:]
        renewals = sum(1 for q in sent if any(mark in q for mark in RENEWALS))
        two_phase = None if before_2pc is None else (after_2pc or 0) - before_2pc
        return Cost(len(sent), two_phase, renewals)


async def _two_phase(conn: asyncpg.Connection) -> int | None:
    if not await conn.fetchval("SELECT to_regclass('pg_dist_transaction') IS NOT NULL"):
        return None
    return int(await conn.fetchval("SELECT count(*) FROM pg_dist_transaction"))


SETTLED = """
    SELECT NOT EXISTS (SELECT 1 FROM turn_runs WHERE status IN ('queued', 'in_progress'))
       AND NOT EXISTS (SELECT 1 FROM owner_turns WHERE until > now())
       AND NOT EXISTS (SELECT 1 FROM conversations WHERE lease_expires_at > now())
"""


async def _settled(conn: asyncpg.Connection, timeout_s: float = 30) -> None:
    """Until no turn runs and nothing is held (a turn's last statements may follow its
    answer: its place given back, its lease released)."""
    deadline = time.monotonic() + timeout_s
    while not await conn.fetchval(SETTLED):
        assert time.monotonic() < deadline, "a turn still runs or holds something"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def replica(url: str, held_s: float = HELD_S, **settings: Any) -> AsyncIterator[Replica]:
    """An app on the database at ``url`` as ``turnstore serve`` wires it (history cache
    included), its pool's statements logged. ``settings`` override the defaults here
    (``turn_lease_s``: LEASE_S, so that what a turn holds is renewed while it runs)."""
    config = Settings(**{"database_url": url, "turn_lease_s": LEASE_S, **settings})
    engine = create_engine(url, pool_size=8)
    log = _Log()

    @event.listens_for(engine.sync_engine, "connect")
    def _logged(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.driver_connection.add_query_logger(log)

    store = postgres_store(engine, config)
    store = replace(store, history=CachedStore(store.history, config.history_cache_bytes))
    api = FakeResponsesAPI()
    app = create_app(config, backend=postgres_backend(config, store=store), provider=api.provider())
    async with (
        serve(app) as base,
        httpx.AsyncClient(base_url=base, timeout=30, verify=TLS) as client,
    ):
        yield Replica(url, client, api, log, held_s)


# --- the kinds --------------------------------------------------------------------------------


async def _ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json())


@dataclass
class Conversations:
    """The conversations the kinds go on (made before: their turns are warm ones)."""

    chat: str = ""
    v1: str = ""
    response: str = ""  # the last /v1 response of a chain (its conversation's head)
    others: list[str] = field(default_factory=list)  # for turns at once


async def prepare(r: Replica) -> Conversations:
    made = Conversations()
    made.chat = str(
        (await _ok(await r.client.post(CHAT, json={"message": "first"})))["conversation_id"]
    )
    for _ in range(4):
        started = await _ok(await r.client.post(CHAT, json={"message": "first"}))
        made.others.append(str(started["conversation_id"]))
    made.v1 = str((await _ok(await r.client.post("/v1/conversations", json={})))["id"])
    # A stored response of a conversation of its own, which chained turns continue.
    made.response = str(
        (await _ok(await r.client.post("/v1/responses", json={"input": "first"})))["id"]
    )
    return made


def kinds(made: Conversations) -> dict[str, Callable[[Replica], Awaitable[None]]]:
    """Each kind of turn, on its conversation, held by its provider for HELD_S."""

    async def new_conversation(r: Replica) -> None:
        r.held()
        await _ok(await r.client.post(CHAT, json={"message": "hello"}))

    async def plain(r: Replica) -> None:
        r.held()
        await _ok(await r.client.post(CHAT, json={"message": "hi", "conversation_id": made.chat}))

    async def streamed(r: Replica) -> None:
        r.held()
        body = {"message": "hi", "conversation_id": made.chat}
        assert (await event_names(r.client, "POST", STREAM, json=body))[-1] == "message.done"

    async def idempotent(r: Replica) -> None:
        r.held()
        body = {"message": "hi", "conversation_id": made.chat}
        await _ok(await r.client.post(CHAT, json=body, headers=_key()))

    async def idempotent_new(r: Replica) -> None:
        r.held()
        await _ok(await r.client.post(CHAT, json={"message": "hello"}, headers=_key()))

    async def idempotent_streamed(r: Replica) -> None:
        r.held()
        body = {"message": "hi", "conversation_id": made.chat}
        names = await event_names(r.client, "POST", STREAM, json=body, headers=_key())
        assert names[-1] == "message.done", names

    async def in_background(r: Replica) -> None:
        r.held()
        await background(r.client, message="hi", conversation_id=made.chat)

    async def resumed(r: Replica) -> None:
        """A background turn followed from its first event to its end (another reader)."""
        r.held()
        started = await background(r.client, message="hi", conversation_id=made.chat)
        assert (await follow(r.client, started["turn_id"]))[-1].name == "message.done"

    async def cancelled(r: Replica) -> None:
        """A background turn cancelled while its provider answers (it never does)."""
        answer, renewals = Script(gate=asyncio.Event()), r.renewals()
        r.api.then(answer)
        started = await background(r.client, message="stop", conversation_id=made.chat)
        await answer.started.wait()
        await r.renewed(renewals)  # a long turn, cancelled
        await _ok(await r.client.post(f"{TURNS}/{started['turn_id']}/cancel"))
        assert (await follow(r.client, started["turn_id"]))[-1].name == "error"
        assert answer.gate is not None
        answer.gate.set()

    async def at_once(r: Replica) -> None:
        """Plain turns at once, one on each of four conversations (on both workers)."""

        async def one(cid: str) -> None:
            body = {"message": "hi", "conversation_id": cid}
            await _ok(await r.client.post(CHAT, json=body))

        for _ in made.others:
            r.held()
        await asyncio.gather(*(one(cid) for cid in made.others))

    async def v1(r: Replica) -> None:
        r.held()
        await _ok(
            await r.client.post("/v1/responses", json={"conversation": made.v1, "input": "hi"})
        )

    async def v1_streamed(r: Replica) -> None:
        r.held()
        body = {"conversation": made.v1, "input": "hi", "stream": True}
        names = await event_names(r.client, "POST", "/v1/responses", json=body)
        assert "response.completed" in names, names

    async def v1_chained(r: Replica) -> None:
        r.held()
        body = {"previous_response_id": made.response, "input": "more"}
        made.response = str((await _ok(await r.client.post("/v1/responses", json=body)))["id"])

    return {
        "plain, new conversation": new_conversation,
        "plain": plain,
        "streamed /api/v1": streamed,
        "background": in_background,
        "background, followed (resume)": resumed,
        "background, cancelled": cancelled,
        "4 plain turns at once": at_once,
        "/v1": v1,
        "/v1 streamed": v1_streamed,
        "/v1 chained (previous_response_id)": v1_chained,
        # Their keys live on the coordinator (deploy/SCALE-OUT.md, "Each owner's rows"): the
        # commit completes the key there, and writes the conversation's worker only.
        "plain with an Idempotency-Key": idempotent,
        "new conversation with an Idempotency-Key": idempotent_new,
        "streamed /api/v1 with an Idempotency-Key": idempotent_streamed,
    }


def _key() -> dict[str, str]:
    return {"Idempotency-Key": f"k-{time.monotonic_ns()}"}


async def measure_all(url: str, held_s: float = HELD_S, **settings: Any) -> dict[str, Cost]:
    """Each kind's cost, in turn, on one replica over the database at ``url``."""
    async with replica(url, 0.0, **settings) as r:
        made = await prepare(r)
        for kind in kinds(made).values():  # once unheld first: the pool's connections made
            await r.measure(kind)
        r.held_s = held_s
        return {name: await r.measure(kind) for name, kind in kinds(made).items()}
