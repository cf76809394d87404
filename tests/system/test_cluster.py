"""Many replicas, one database, as real processes: three `turnstore serve` behind nginx (and
once behind PgBouncer in transaction mode), concurrent upgrades, readiness that follows a
migration run elsewhere, and `serve --workers`.

The cluster run drives turns on a few shared conversations, through the load balancer and
directly at each replica, while the fake Responses API (served over HTTP by this process)
records what every turn sent. Afterwards the stored state must be exactly what the clients
were told: each conversation's revision is its number of 200s, every 200 sits in the
transcript at its revision, no 409 left anything behind, and every committed turn's provider
input was the replay items of the turns before it, byte for byte (JSON-equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse
from sqlalchemy import text

from service.platform import migrate
from service.platform.db import create_engine
from service.platform.embedded import EmbeddedPostgres
from tests.support.cluster import (
    TURNSTORE,
    Replica,
    fake_api,
    nginx,
    pgbouncer,
    process,
    provider_env,
    replica,
    turnstore_env,
    wait_ready,
    workdir,
)
from tests.support.fakeapi import FakeResponsesAPI, output_items

CHAT = "/api/v1/chat"
CONVERSATIONS = 6
REQUESTS = 60  # per conversation, the first of which creates it
CONCURRENCY = 24
PROVIDER_DELAY_S = 0.02  # long enough for turns of one conversation to overlap
STREAM_EVERY = 5  # every 5th request is a stream
REPORT: list[str] = []  # printed after each test, past pytest's capture
REFUSED = ("conversation_conflict", "conversation_busy")  # nothing kept; retry


@dataclass(frozen=True)
class Job:
    conversation: int
    number: int
    target: int  # 0: the load balancer; 1..3: that replica directly
    stream: bool

    @property
    def message(self) -> str:
        return f"conversation {self.conversation} message {self.number}"


@dataclass(frozen=True)
class Outcome:
    job: Job
    committed: bool  # False: 409 conversation_conflict (or its SSE error)
    reply: str | None = None
    revision: int | None = None


class Driver:
    """Sends the jobs with bounded concurrency and sorts every answer into committed,
    conflict or unexpected (anything else fails the test)."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self.clients = clients
        self.ids: dict[int, str] = {}
        self.outcomes: list[Outcome] = []
        self.unexpected: list[str] = []

    async def run(self, jobs: list[Job], concurrency: int) -> None:
        queue = iter(jobs)  # shared: next() never awaits, so each job is taken exactly once

        async def worker() -> None:
            for job in queue:
                await self.send(job)

        async with asyncio.TaskGroup() as group:  # one failing worker stops the others
            for _ in range(concurrency):
                group.create_task(worker())

    async def send(self, job: Job) -> None:
        client = self.clients[job.target]
        body = {"message": job.message, "conversation_id": self.ids.get(job.conversation)}
        if not job.stream:
            response = await client.post(CHAT, json=body)
            if response.status_code == 200:
                data = response.json()
                self.ids.setdefault(job.conversation, data["conversation_id"])
                self.outcomes.append(Outcome(job, True, data["message"], data["revision"]))
            elif _code(response) in REFUSED and response.status_code == 409:
                self.outcomes.append(Outcome(job, False))
            else:
                self.unexpected.append(f"{job}: {response.status_code} {response.text}")
            return
        async with aconnect_sse(client, "POST", f"{CHAT}/stream", json=body) as source:
            if source.response.status_code != 200:
                await source.response.aread()
                self.unexpected.append(f"{job}: {source.response.status_code}")
                return
            events = [(event.event, json.loads(event.data)) async for event in source.aiter_sse()]
        names = [name for name, _ in events]
        terminal = [i for i, name in enumerate(names) if name in ("message.done", "error")]
        reply = "".join(data["delta"] for name, data in events if name == "message.delta")
        last = events[-1][1] if events else {}
        if terminal != [len(events) - 1]:
            self.unexpected.append(f"{job}: events {names}")
        elif names[-1] == "message.done" and last["revision"] is not None:
            self.outcomes.append(Outcome(job, True, reply, last["revision"]))
        elif names[-1] == "error" and last["error"]["code"] in REFUSED:
            self.outcomes.append(Outcome(job, False))
        else:
            self.unexpected.append(f"{job}: {events[-1]}")


def _code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def _jobs() -> tuple[list[Job], list[Job]]:
    """The first turn of each conversation, then the rest interleaved over conversations and
    spread over the load balancer and the three replicas."""
    first = [Job(c, 0, 0, False) for c in range(CONVERSATIONS)]
    rest = [
        Job(c, n, (c + n) % 4, n % STREAM_EVERY == 0)
        for n in range(1, REQUESTS)
        for c in range(CONVERSATIONS)
    ]
    return first, rest


async def _replay_items(database: str) -> dict[str, list[tuple[int, str, list[Any]]]]:
    """conversation id -> [(seq, user message, replay items)] in seq order, read directly."""
    engine = create_engine(database, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT conversation_id::text, seq, user_message, replay_items::text "
                    "FROM turns ORDER BY conversation_id, seq"
                )
            )
            stored: dict[str, list[tuple[int, str, list[Any]]]] = defaultdict(list)
            for cid, seq, message, items in rows:
                stored[cid].append((seq, message, json.loads(items)))
            return stored
    finally:
        await engine.dispose()


async def _check(
    driver: Driver, api: FakeResponsesAPI, lb: httpx.AsyncClient, database: str
) -> None:
    assert not driver.unexpected, driver.unexpected[:10]
    stored = await _replay_items(database)
    sent = Counter(_user_text(request["input"][-1]) for request in api.requests)
    requests = {_user_text(request["input"][-1]): request for request in api.requests}
    assert max(sent.values()) == 1, "a message went to the provider twice"
    by_conversation: dict[int, list[Outcome]] = defaultdict(list)
    for outcome in driver.outcomes:
        by_conversation[outcome.job.conversation].append(outcome)

    for conversation, outcomes in by_conversation.items():
        cid = driver.ids[conversation]
        response = await lb.get(f"/api/v1/conversations/{cid}", params={"limit": 200})
        assert response.status_code == 200, response.text
        transcript = response.json()
        messages = [(m["role"], m["content"]) for m in transcript["messages"]]
        committed = sorted((o for o in outcomes if o.committed), key=lambda o: o.revision or 0)
        # The revision counts exactly the 200s, and each 200 holds its own revision.
        assert transcript["revision"] == len(committed)
        assert [o.revision for o in committed] == list(range(1, len(committed) + 1))
        assert len(messages) == 2 * len(committed)
        for o in committed:
            at = 2 * ((o.revision or 0) - 1)
            assert messages[at : at + 2] == [("user", o.job.message), ("assistant", o.reply)]
        # A 409 left nothing behind.
        users = {content for role, content in messages if role == "user"}
        assert not any(o.job.message in users for o in outcomes if not o.committed)

        # Each committed turn sent exactly the replay items of the turns before it, and stored
        # exactly what the provider answered.
        turns = stored[cid]
        assert [seq for seq, _, _ in turns] == list(range(1, len(committed) + 1))
        history: list[Any] = []
        for (_, message, items), o in zip(turns, committed, strict=True):
            assert message == o.job.message == _user_text(items[0])
            number = int((o.reply or "").removeprefix("reply "))  # the fake's call number
            assert items[1:] == output_items(number, o.reply or "", reasoning=True)
            assert requests[message]["input"] == [*history, items[0]]
            history.extend(items)


def _user_text(item: dict[str, Any]) -> str:
    assert item["role"] == "user", item
    return str(item["content"][0]["text"])


async def _run_cluster(
    label: str, database: str, replica_database: str, tmp_path: Path, **settings: str
) -> None:
    """With TURN_CONCURRENCY=reject, turns that met another turn of their conversation are
    refused (409); with queue (the default) every turn commits, one after the other."""
    api = FakeResponsesAPI()
    async with fake_api(api, delay_s=PROVIDER_DELAY_S) as base_url:
        env = turnstore_env(
            DATABASE_URL=replica_database, DB_POOL_SIZE="5", **provider_env(base_url), **settings
        )
        with ExitStack() as stack:
            replicas: list[Replica] = [
                stack.enter_context(replica(env, tmp_path / f"{label}-replica-{i}.log"))
                for i in (1, 2, 3)
            ]
            stack.callback(
                lambda: [r.process.signal(signal.SIGTERM) for r in replicas]
            )  # all at once
            await asyncio.gather(*(wait_ready(r) for r in replicas))
            lb_url = stack.enter_context(nginx([r.url for r in replicas]))
            clients = [
                httpx.AsyncClient(base_url=url, timeout=30)
                for url in (lb_url, *(r.url for r in replicas))
            ]
            driver = Driver(clients)
            first, rest = _jobs()
            try:
                await asyncio.wait_for(driver.run(first, CONVERSATIONS), 30)
                assert not driver.unexpected, driver.unexpected
                started = time.monotonic()
                await asyncio.wait_for(driver.run(rest, CONCURRENCY), 120)
                elapsed = time.monotonic() - started
                await _check(driver, api, clients[0], database)
            except BaseException:
                for r in replicas:  # shown by pytest with the failure
                    print(f"--- {r.url}\n{r.process.tail()}")
                raise
            finally:
                for client in clients:
                    await client.aclose()
    load = [o for o in driver.outcomes if o.job.number > 0]
    commits = sum(o.committed for o in load)
    refused = len(load) - commits
    REPORT.append(
        f"cluster ({label}, TURN_CONCURRENCY={settings.get('TURN_CONCURRENCY', 'queue')}): "
        f"{len(load)} turns sent in {elapsed:.1f} s ({len(load) / elapsed:.0f} requests/s, "
        f"concurrency {CONCURRENCY}): {commits} committed ({commits / elapsed:.0f} turns/s), "
        f"{refused} refused (409), {len(api.requests)} provider calls"
    )
    if settings.get("TURN_CONCURRENCY") == "reject":
        assert refused > 0  # the race was real: turns met on the same conversation
    else:
        assert refused == 0  # queued, never refused
    # The lease spares the provider: no call for a turn that could only lose.
    assert len(api.requests) == sum(o.committed for o in driver.outcomes)


async def test_three_replicas_behind_nginx_on_one_database(database: str, tmp_path: Path) -> None:
    await _run_cluster("direct", database, database, tmp_path, TURN_CONCURRENCY="reject")


async def test_three_replicas_through_pgbouncer_in_transaction_mode(
    database: str, tmp_path: Path
) -> None:
    with pgbouncer(database, pool_size=4) as pooled:
        await _run_cluster("pgbouncer", database, pooled, tmp_path, DB_STATEMENT_CACHE_SIZE="0")


# --- migrations from several places, readiness that follows them ------------------------


async def test_concurrent_upgrades_and_readyz_flips_without_restart(
    empty_database: str, tmp_path: Path
) -> None:
    env = turnstore_env(DATABASE_URL=empty_database)  # fake provider
    with replica(env, tmp_path / "serve.log") as server:
        await wait_ready(server, status=503)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert _code(await client.get("/readyz")) == "not_ready"
            with ExitStack() as stack:
                upgrades = [
                    stack.enter_context(
                        process([TURNSTORE, "db", "upgrade"], tmp_path / f"up-{i}.log", env)
                    )
                    for i in range(3)
                ]
                statuses = [await p.wait(60) for p in upgrades]
                assert statuses == [0, 0, 0], [p.tail() for p in upgrades]
            # Every migration of both chains ran exactly once, whichever runner ran it (the
            # data's and the keyring's chains are two runs under the lock: another runner may
            # take the second).
            ran = [
                line.split("Running upgrade", 1)[1].split(",", 1)[0].strip()
                for p in upgrades
                for line in p.log.read_text().splitlines()
                if "Running upgrade" in line
            ]
            assert sorted(ran) == sorted(set(ran)), [p.tail() for p in upgrades]
            assert len(ran) == len(migrate.known_revisions()) + 1, ran  # and the keyring's k001
            await wait_ready(server, status=200, timeout_s=10)
            turn = await client.post(CHAT, json={"message": "after the migration"})
            assert turn.status_code == 200, turn.text
    engine = create_engine(empty_database, pool_size=1)
    try:
        async with engine.connect() as conn:
            versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).all()
    finally:
        await engine.dispose()
    assert [v for (v,) in versions] == [migrate.head_revision()]


# --- serve --workers -----------------------------------------------------------------------


def _workers(pid: int) -> list[int]:
    """The uvicorn workers among the children (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        children = [int(child) for child in fh.read().split()]
    workers = []
    for child in children:
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{child}/cmdline", "rb") as fh:
            if b"spawn_main" in fh.read():
                workers.append(child)
    return workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _workers_serve_and_stop(server: Replica, timeout_s: float = 60) -> None:
    """Turns on new conversations at once, then reads each back (any worker may answer);
    SIGTERM stops the supervisor and its workers with status 0."""
    await wait_ready(server, timeout_s=timeout_s)
    workers = _workers(server.process.popen.pid)
    assert len(workers) == 2, workers
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        turns = await asyncio.gather(
            *(client.post(CHAT, json={"message": f"worker turn {i}"}) for i in range(8))
        )
        assert [t.status_code for t in turns] == [200] * 8, [t.text for t in turns]
        for t in turns:
            read = await client.get(f"/api/v1/conversations/{t.json()['conversation_id']}")
            assert read.status_code == 200 and read.json()["revision"] == 1
        cid = turns[0].json()["conversation_id"]
        for revision in (2, 3, 4):
            more = await client.post(CHAT, json={"message": "again", "conversation_id": cid})
            assert more.status_code == 200 and more.json()["revision"] == revision, more.text
    server.process.signal(signal.SIGTERM)
    assert await server.process.wait(20) == 0, server.process.tail()
    assert not [pid for pid in workers if _alive(pid)]


async def test_workers_share_one_database_url(database: str, tmp_path: Path) -> None:
    env = turnstore_env(DATABASE_URL=database)
    with replica(env, tmp_path / "serve.log", "--workers", "2") as server:
        await _workers_serve_and_stop(server)


async def test_workers_share_the_embedded_database_the_parent_started(tmp_path: Path) -> None:
    with workdir("embedded") as base:
        pgdata = base / ".turnstore" / "pgdata"
        env = turnstore_env(TURNSTORE_DATA_DIR=str(base / ".turnstore"))  # no DATABASE_URL
        try:
            with replica(env, tmp_path / "serve.log", "--workers", "2") as server:
                await _workers_serve_and_stop(server, timeout_s=90)
            # The parent started and migrated it (once), and stopped it on the way out.
            assert server.process.log.read_text().count("turnstore is serving") == 1
            assert not (pgdata / "postmaster.pid").exists()
        finally:
            if (pgdata / "postmaster.pid").exists():  # the test failed: don't orphan it
                EmbeddedPostgres(url="", data_dir=pgdata, started_here=True).stop()
