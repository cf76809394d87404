"""Failover of the database under load (issue 17): two real `turnstore serve` replicas on a
synchronous primary/standby pair (tests/support/replication.py), reached through the contract's
multi-host ``DATABASE_URL`` with ``target_session_attrs=read-write``.

Eight clients send turns, each to one replica and one of four shared conversations (every
conversation has one client on each replica, so the replicas race each other), every third
one streamed, each with ``If-Match`` set to the revision its client last saw. Every message is
unique and sent once: a message found in a transcript names the request that made it. While
the load runs, the primary is SIGKILLed, timed into commits in flight: replay is paused on the
standby first, so that COMMITs (``remote_apply``) wait with their record already on the
standby's disk, and the kill comes once some do. Once both replicas' /readyz say 503 and a
turn sent to each has failed, the standby is promoted; the load goes on until both replicas
commit again. Clients pause ``BACKOFF_S`` after a failure, as a client would.

What must hold afterwards, read back through both replicas:

- every acknowledged turn (200, or ``message.done`` with a revision) is in its transcript at
  its revision with its reply; each conversation's revision is its number of turns, each turn
  number appears once, no message twice;
- a turn that got a definite "not committed" (412 ``precondition_failed``, 409
  ``conversation_conflict``) left no trace;
- a turn answered 500 ``storage_error`` may be there, but only if it was sent before the
  primary died: its commit was cut off, and whether the standby had it is unknowable (see
  tests/support/replication.py); those are counted, not failed (and the commits that waited for the
  paused standby must be among them: the kill did cut commits off);
- storage_error only from the kill until the replica's /readyz is 200 again;
- no other answer than these (no ``internal_error``, no broken stream);
- every stored turn sent the provider exactly the replay items before it (the history cache
  must not carry anything across the failover that the new primary does not have);
- both replicas served again without a restart; /readyz was 503 while no writable primary was
  reachable and 200 after the promotion.

The report gives each replica's storage_error window (first failure to first success after the
promotion) and the outcome counts.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from httpx_sse import aconnect_sse

from migrations.commit_function import COMMIT_RUN, COMMIT_V3
from tests.support.cluster import (
    TURNSTORE,
    Replica,
    fake_api,
    process,
    provider_env,
    replica,
    turnstore_env,
    wait_ready,
    wait_until,
)
from tests.support.fakeapi import FakeResponsesAPI, output_items
from tests.support.replication import Node, ReplicatedPostgres

CHAT = "/api/v1/chat"
REPLICAS = 2
CONVERSATIONS = 4
CLIENTS = REPLICAS * CONVERSATIONS  # client i: replica i // CONVERSATIONS, conversation i % 4
STREAM_EVERY = 3  # every third turn of a client is streamed
PROVIDER_DELAY_S = 0.02  # turns overlap, so the kill finds commits in flight
BEFORE_KILL = 40  # acknowledged turns before the primary is killed
AFTER_PROMOTION = 3  # acknowledged turns per replica after the promotion before stopping
IN_FLIGHT = 2  # commits waiting for the standby when the primary is killed
BACKOFF_S = 0.05  # a client's pause after a failure (a client does not retry in a busy loop)
TIMEOUT_S = 20.0  # any single wait
DEFINITELY_NOT_COMMITTED = {"precondition_failed", "conversation_conflict"}
UNKNOWABLE = "storage_error"
REPORT: list[str] = []


@dataclass(frozen=True)
class Outcome:
    client: int
    replica: int
    conversation: int
    message: str
    stream: bool
    started: float  # time.monotonic()
    finished: float
    code: str  # "ok" when acknowledged, else the error code (or what went wrong)
    revision: int | None = None
    reply: str | None = None

    @property
    def acknowledged(self) -> bool:
        return self.code == "ok"


class Load:
    """The clients: each sends its turns one after the other until ``stop`` is set, records
    every answer, and after a 412 or 409 reads its conversation's revision afresh."""

    def __init__(self, clients: list[httpx.AsyncClient], ids: list[str]) -> None:
        self.clients = clients  # one per replica
        self.ids = ids  # conversation number -> id
        self.outcomes: list[Outcome] = []
        self.stop = asyncio.Event()

    def acknowledged(self, replica: int, since: float = 0.0) -> int:
        return sum(
            o.acknowledged and o.replica == replica and o.finished > since for o in self.outcomes
        )

    async def client(self, number: int, revision: int) -> None:
        target, conversation = divmod(number, CONVERSATIONS)
        turn = 0
        while not self.stop.is_set():
            turn += 1
            message = f"client {number} turn {turn}"
            stream = turn % STREAM_EVERY == 0
            started = time.monotonic()
            try:
                code, new_revision, reply = await self.send(
                    target, conversation, message, stream, revision
                )
            except httpx.TransportError as error:
                code, new_revision, reply = f"transport {type(error).__name__}", None, None
            outcome = Outcome(
                number, target, conversation, message, stream, started, time.monotonic(), code,
                new_revision, reply,
            )  # fmt: skip
            self.outcomes.append(outcome)
            if outcome.acknowledged:
                assert new_revision is not None
                revision = new_revision
            elif code in DEFINITELY_NOT_COMMITTED:
                revision = await self.current_revision(target, conversation) or revision
            else:
                await asyncio.sleep(BACKOFF_S)

    async def send(
        self, target: int, conversation: int, message: str, stream: bool, revision: int
    ) -> tuple[str, int | None, str | None]:
        client = self.clients[target]
        cid = self.ids[conversation]
        body = {"message": message, "conversation_id": cid}
        headers = {"If-Match": f'"{revision}"'}
        if not stream:
            response = await client.post(CHAT, json=body, headers=headers)
            if response.status_code != 200:
                return _code(response), None, None
            data = response.json()
            assert data["conversation_id"] == cid, data
            return "ok", data["revision"], data["message"]
        async with aconnect_sse(
            client, "POST", f"{CHAT}/stream", json=body, headers=headers
        ) as source:
            if source.response.status_code != 200:
                await source.response.aread()
                return _code(source.response), None, None
            # A keep-alive comment is no event (EventSource dispatches none for it).
            events = [
                (event.event, json.loads(event.data))
                async for event in source.aiter_sse()
                if event.data
            ]
        names = [name for name, _ in events]
        terminal = [i for i, name in enumerate(names) if name in ("message.done", "error")]
        if terminal != [len(events) - 1]:
            return f"broken stream {names}", None, None
        last = events[-1][1]
        if names[-1] == "error":
            return str(last["error"]["code"]), None, None
        if last["revision"] is None or last["conversation_id"] != cid:
            return f"message.done without a commit {last}", None, None
        reply = "".join(data["delta"] for name, data in events if name == "message.delta")
        return "ok", last["revision"], reply

    async def current_revision(self, target: int, conversation: int) -> int | None:
        """The revision as the replica sees it now; None while it cannot say (the client then
        keeps its old one: the next turn gets 412 again, or fails)."""
        try:
            response = await self.clients[target].get(
                f"/api/v1/conversations/{self.ids[conversation]}", params={"limit": 1}
            )
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            await asyncio.sleep(BACKOFF_S)
            return None
        return int(response.json()["revision"])


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} without an error envelope"


# --- fixtures --------------------------------------------------------------------------------


@asynccontextmanager
async def _replicas(env: dict[str, str], tmp_path: Path) -> AsyncIterator[list[Replica]]:
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(replica(env, tmp_path / f"replica-{i}.log"))
            for i in range(REPLICAS)
        ]

        def terminate_all() -> None:  # at once, before each one's own stop() waits for it
            for r in replicas:
                r.process.signal(signal.SIGTERM)

        stack.callback(terminate_all)
        await asyncio.gather(*(wait_ready(r) for r in replicas))
        try:
            yield replicas
        except BaseException:
            for r in replicas:  # shown by pytest with the failure
                print(f"--- {r.url}\n{r.process.tail(60)}")
            raise


# --- the test --------------------------------------------------------------------------------


@dataclass
class Timeline:
    """time.monotonic() of each step of the failover."""

    killed: float = 0.0  # kill_primary called
    dead: float = 0.0  # kill_primary returned: every process of the old primary is gone
    unready: tuple[float, ...] = ()  # each replica's first /readyz 503 after that
    promoting: float = 0.0  # promote_standby called
    promoted: float = 0.0  # promote_standby returned: the standby takes writes
    ready: tuple[float, ...] = ()  # each replica's first /readyz 200 after that
    stopped: float = 0.0  # the load stopped


async def test_acknowledged_turns_survive_a_failover_and_replicas_recover(
    pair: ReplicatedPostgres, tmp_path: Path
) -> None:
    test_started = time.monotonic()
    api = FakeResponsesAPI()
    async with fake_api(api, delay_s=PROVIDER_DELAY_S) as base_url:
        env = turnstore_env(DATABASE_URL=pair.url, DB_POOL_SIZE="4", **provider_env(base_url))
        with process([TURNSTORE, "db", "upgrade"], tmp_path / "upgrade.log", env) as upgrade:
            assert await upgrade.wait(60) == 0, upgrade.tail()
        async with _replicas(env, tmp_path) as replicas:
            clients = [httpx.AsyncClient(base_url=r.url, timeout=TIMEOUT_S) for r in replicas]
            try:
                pids = [r.process.popen.pid for r in replicas]
                ids, outcomes, timeline = await _failover_under_load(pair, clients)
                # Both replicas are the processes started before the failover, and ready.
                for r, pid in zip(replicas, pids, strict=True):
                    assert r.process.popen.poll() is None and r.process.popen.pid == pid
                for client in clients:
                    assert (await client.get("/readyz")).status_code == 200
                kept = await _check_transcripts(clients, ids, outcomes, timeline)
                await _check_provider_inputs(pair, api, ids, outcomes)
            finally:
                for client in clients:
                    await client.aclose()
            REPORT.extend(_report(replicas, outcomes, kept, timeline, test_started))


async def _failover_under_load(
    pair: ReplicatedPostgres, clients: list[httpx.AsyncClient]
) -> tuple[list[str], list[Outcome], Timeline]:
    """Creates the conversations, runs the load across the failover; returns the
    conversation ids, every turn's outcome and when each step happened."""
    old_primary, standby = pair.primary, pair.standby
    assert standby is not None
    # The conversations, each created on one replica (their first turns count as acknowledged).
    ids: list[str] = []
    created: list[Outcome] = []
    for conversation in range(CONVERSATIONS):
        message = f"conversation {conversation} created"
        started = time.monotonic()
        target = conversation % REPLICAS
        response = await clients[target].post(CHAT, json={"message": message})
        assert response.status_code == 200, response.text
        data = response.json()
        ids.append(data["conversation_id"])
        created.append(
            Outcome(
                -1, target, conversation, message, False, started, time.monotonic(), "ok",
                data["revision"], data["message"],
            )
        )  # fmt: skip

    at = Timeline()
    load = Load(clients, ids)
    tasks = [asyncio.create_task(load.client(i, 1)) for i in range(CLIENTS)]
    try:
        await _until(
            lambda: sum(o.acknowledged for o in load.outcomes) >= BEFORE_KILL,
            f"{BEFORE_KILL} acknowledged turns before the kill",
        )
        before = [o for o in load.outcomes if o.code not in {"ok", *DEFINITELY_NOT_COMMITTED}]
        assert not before, before[:10]  # nothing fails while the primary is up

        # Kill into commits in flight: with replay paused on the standby, a COMMIT (which
        # waits for remote_apply) has its record on the standby's disk but no answer yet.
        await asyncio.to_thread(pair.sql, standby, "SELECT pg_wal_replay_pause()")
        await _wait_commits_in_flight(old_primary, IN_FLIGHT)
        await asyncio.to_thread(pair.wait_received)
        at.killed = time.monotonic()
        await asyncio.to_thread(pair.kill_primary)
        at.dead = time.monotonic()
        await asyncio.to_thread(pair.sql, standby, "SELECT pg_wal_replay_resume()")

        # No writable primary: each replica's /readyz must say so (and /healthz must not:
        # the process is fine, an orchestrator must not restart it), and turns sent now fail.
        at.unready = tuple(await asyncio.gather(*(_wait_readyz(c, 503) for c in clients)))
        for client in clients:
            assert (await client.get("/healthz")).status_code == 200
        await _until(
            lambda: all(
                any(o.replica == r and o.code == UNKNOWABLE and o.started > at.dead
                    for o in load.outcomes)
                for r in range(REPLICAS)
            ),
            "a turn sent to each replica after the kill to fail",
        )  # fmt: skip

        at.promoting = time.monotonic()
        await asyncio.to_thread(pair.promote_standby)
        at.promoted = time.monotonic()
        assert pair.primary is standby

        at.ready = tuple(await asyncio.gather(*(_wait_readyz(c, 200) for c in clients)))
        await _until(
            lambda: all(
                load.acknowledged(r, since=at.promoted) >= AFTER_PROMOTION for r in range(REPLICAS)
            ),
            f"{AFTER_PROMOTION} acknowledged turns per replica after the promotion",
        )
    finally:
        load.stop.set()
        done, pending = await asyncio.wait(tasks, timeout=TIMEOUT_S)
        for task in pending:
            task.cancel()
    for task in done:
        task.result()  # a client's own failure (an assertion in it) fails the test
    assert not pending, "clients did not stop"
    at.stopped = time.monotonic()
    return ids, created + load.outcomes, at


async def _check_transcripts(
    clients: list[httpx.AsyncClient], ids: list[str], outcomes: list[Outcome], at: Timeline
) -> list[Outcome]:
    """The rules of the module docstring, on the transcripts as both replicas read them;
    returns the storage_error turns that committed anyway."""
    unexpected = [
        o for o in outcomes
        if not o.acknowledged and o.code not in {*DEFINITELY_NOT_COMMITTED, UNKNOWABLE}
    ]  # fmt: skip
    assert not unexpected, unexpected[:10]
    # The database failed only while the failover lasted: from the kill until the replica's
    # /readyz said 200 again (its pool hands out no broken connection after that).
    for o in outcomes:
        if o.code == UNKNOWABLE:
            assert at.killed <= o.finished and o.started < at.ready[o.replica], o

    transcripts = [{cid: await _transcript(client, cid) for cid in ids} for client in clients]
    assert transcripts[0] == transcripts[1]
    by_message = {o.message: o for o in outcomes}
    kept: list[Outcome] = []
    for conversation, cid in enumerate(ids):
        view = transcripts[0][cid]
        numbers = [turn["turn"] for turn in view["turns"]]
        assert numbers == list(range(1, view["revision"] + 1)), (cid, numbers)
        messages = [(m["role"], m["content"]) for m in view["messages"]]
        assert [role for role, _ in messages] == ["user", "assistant"] * view["revision"]
        users = [content for role, content in messages if role == "user"]
        assert len(set(users)) == len(users), "a turn was committed twice"
        # Every acknowledged turn, at its revision, with its reply.
        for o in outcomes:
            if o.acknowledged and o.conversation == conversation:
                assert o.revision is not None
                i = 2 * (o.revision - 1)
                assert messages[i : i + 2] == [("user", o.message), ("assistant", o.reply)], o
        # Every stored turn is an acknowledged one, or one whose commit the kill cut off.
        for revision, message in enumerate(users, start=1):
            sender = by_message.get(message)
            assert sender is not None and sender.conversation == conversation, (message, cid)
            if sender.acknowledged:
                assert sender.revision == revision, sender
                continue
            assert sender.code == UNKNOWABLE, f"{sender} left a trace at revision {revision}"
            assert sender.started < at.dead, f"{sender} was sent after the primary was dead"
            kept.append(sender)
    # The kill did cut commits off: those that waited for the paused standby are there.
    assert len(kept) >= IN_FLIGHT, kept
    return kept


def _report(
    replicas: list[Replica],
    outcomes: list[Outcome],
    kept: list[Outcome],
    at: Timeline,
    test_started: float,
) -> list[str]:
    lines = [
        f"failover: kill_primary {at.dead - at.killed:.3f} s, /readyz 503 on both replicas "
        f"{max(at.unready) - at.dead:.3f} s after it, promote_standby "
        f"{at.promoted - at.promoting:.3f} s, /readyz 200 on both "
        f"{max(at.ready) - at.promoted:.3f} s after the promotion; "
        f"no writable primary (kill to promoted) for {at.promoted - at.killed:.3f} s"
    ]
    for r, replica_ in enumerate(replicas):
        errors = [o for o in outcomes if o.replica == r and o.code == UNKNOWABLE]
        first_error = min(o.finished for o in errors)  # there is one: waited for
        first_ok = min(
            o.finished
            for o in outcomes
            if o.replica == r and o.acknowledged and o.finished > at.promoted
        )
        phases = Counter(
            "cut off by the kill" if o.started < at.dead
            else "sent while no primary was writable" if o.started < at.promoted
            else "sent after the promotion"
            for o in errors
        )  # fmt: skip
        lines.append(
            f"  replica {r}: storage_error from kill +{first_error - at.killed:.3f} s to the "
            f"first success at kill +{first_ok - at.killed:.3f} s: "
            f"{first_ok - first_error:.3f} s; {len(errors)} storage_errors "
            f"({', '.join(f'{n} {phase}' for phase, n in phases.items())}); "
            f"logged causes: {_storage_causes(replica_)}"
        )
    codes = Counter(o.code for o in outcomes)
    acknowledged = codes.pop("ok")
    lines.append(
        f"  {len(outcomes)} turns, the load stopped {at.stopped - test_started:.1f} s after the "
        f"test started: {acknowledged} acknowledged, {sum(codes.values())} not "
        f"({', '.join(f'{n} {code}' for code, n in codes.most_common())}); "
        f"{len(kept)} storage_error turns committed anyway (their commit was cut off by the "
        f"kill; found on the promoted standby)"
    )
    return lines


async def _until(check: Callable[[], bool], what: str) -> None:
    async def checked() -> bool:
        return check()

    await wait_until(checked, what, TIMEOUT_S)


async def _wait_commits_in_flight(node: Node, count: int) -> None:
    """Until ``count`` turn commits of ``node`` wait for their synchronous standby (an
    observer's connection to that node alone). Lease statements wait there too: not those.
    A plain turn commits in one statement (the commit function's, migrations/commit_function.py),
    a durable one in another (the commit that ends its run), a forked one with COMMIT."""
    conn = await asyncpg.connect(node.dsn, timeout=5)
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' "
        f"AND (query LIKE 'COMMIT%' OR query LIKE '%FROM {COMMIT_V3.name}(%'"
        f" OR query LIKE '%FROM {COMMIT_RUN.name}(%')"
    )
    try:

        async def waiting() -> bool:
            return int(await conn.fetchval(query)) >= count

        await wait_until(waiting, f"{count} commits to wait for the standby", TIMEOUT_S)
    finally:
        await conn.close()


async def _wait_readyz(client: httpx.AsyncClient, status: int) -> float:
    """When ``client``'s replica first answered /readyz with ``status``."""

    async def answers() -> bool:
        return (await client.get("/readyz")).status_code == status

    await wait_until(answers, f"{client.base_url}/readyz to answer {status}", TIMEOUT_S)
    return time.monotonic()


async def _transcript(client: httpx.AsyncClient, cid: str) -> dict[str, Any]:
    """The whole conversation, page by page (``limit`` is at most 200)."""
    view: dict[str, Any] | None = None
    after = 0
    while True:
        response = await client.get(
            f"/api/v1/conversations/{cid}", params={"limit": 200, "after": after}
        )
        assert response.status_code == 200, response.text
        page = response.json()
        if view is None:
            view = page
        else:
            assert page["revision"] == view["revision"]
            view["turns"] += page["turns"]
            view["messages"] += page["messages"]
        if not page["more_after"]:
            break
        after = page["turns"][-1]["turn"]
    for key in ("more_after", "more_before"):
        view.pop(key)
    return view


async def _check_provider_inputs(
    pair: ReplicatedPostgres, api: FakeResponsesAPI, ids: list[str], outcomes: list[Outcome]
) -> None:
    """Every stored turn sent exactly the replay items of the turns before it, and stored what
    the provider answered; no message reached the provider twice, a 412 never."""
    sent = Counter(_user_text(request["input"][-1]) for request in api.requests)
    assert max(sent.values()) == 1, "a message went to the provider twice"
    refused = {o.message for o in outcomes if o.code == "precondition_failed"}
    assert not refused & set(sent), "If-Match is checked before the provider is called"
    requests = {_user_text(request["input"][-1]): request for request in api.requests}
    conn = await asyncpg.connect(pair.primary.dsn, timeout=5)  # the new primary alone
    try:
        rows = await conn.fetch(
            "SELECT conversation_id::text AS cid, seq, user_message, assistant_message, "
            "replay_items::text AS items FROM turns ORDER BY conversation_id, seq"
        )
    finally:
        await conn.close()
    stored: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        stored[row["cid"]].append(row)
    assert set(stored) == set(ids)
    for cid in ids:
        history: list[Any] = []
        for row in stored[cid]:
            items = json.loads(row["items"])
            assert row["user_message"] == _user_text(items[0])
            number = int(row["assistant_message"].removeprefix("reply "))  # the fake's call
            assert items[1:] == output_items(number, row["assistant_message"], reasoning=True)
            assert requests[row["user_message"]]["input"] == [*history, items[0]], (cid, row["seq"])
            history.extend(items)


def _user_text(item: dict[str, Any]) -> str:
    assert item["role"] == "user", item
    return str(item["content"][0]["text"])


def _storage_causes(replica: Replica) -> str:
    """What the replica logged as the causes of its storage_errors (class and SQLSTATE)."""
    causes: Counter[str] = Counter()
    text = replica.process.log.read_text(errors="replace")
    for match in re.finditer(r"storage_error: (\w+) sqlstate=(\w+)", text):
        causes[f"{match[1]}" + (f"/{match[2]}" if match[2] != "None" else "")] += 1
    return ", ".join(f"{n} {cause}" for cause, n in causes.most_common()) or "none logged"
