"""Limits: one owner cannot hurt the others (the contract's "Limits")."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from service.core.ids import Ids
from service.core.sizes import held_bytes
from service.store.postgres import PostgresStore
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer

TURNS = "/api/v1/turns"


async def opened(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> int:
    """The status a reader of ``url`` is answered with (the stream is left at once)."""
    async with client.stream("GET", url, headers=headers) as response:
        return response.status_code


async def until_opened(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float = 10
) -> None:
    """A slot frees when the server has seen a reader go: poll until a new one is let in."""
    deadline = time.monotonic() + timeout_s
    while (status := await opened(client, url, headers)) == 429:
        assert time.monotonic() < deadline, "no reader's slot was freed"
        await asyncio.sleep(0.02)
    assert status == 200, status


async def test_an_owner_past_their_event_readers_gets_429_and_others_read_on(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI()
    stall = asyncio.Event()
    api.then(*(Script(text="slow reply", deltas=3, stall=stall) for _ in range(3)))
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    settings: dict[str, Any] = {"owner_max_event_readers": 2, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        started = [
            await client.post(CHAT, json={"message": m, "background": True}, headers=who)
            for m, who in (("a", alice), ("b", bob))
        ]
        a_turn, b_turn = (s.json()["turn_id"] for s in started)
        made = await client.post("/v1/responses", json={"input": "c", "background": True},
                                 headers=alice)  # fmt: skip
        a_response = made.json()["id"]
        async with AsyncExitStack() as readers:
            for _ in range(2):
                source = await readers.enter_async_context(
                    aconnect_sse(client, "GET", f"{TURNS}/{a_turn}/events", headers=alice)
                )
                assert source.response.status_code == 200
            refused = await client.get(f"{TURNS}/{a_turn}/events", headers=alice)
            assert_error(refused, 429, "too_many_requests")  # JSON, before any stream
            assert refused.headers["Retry-After"] == "1"
            resumed = await client.get(f"/v1/responses/{a_response}?stream=true", headers=alice)
            assert resumed.status_code == 429, resumed.text
            assert resumed.json()["error"]["code"] == "too_many_requests"
            # Another owner reads on.
            assert await opened(client, f"{TURNS}/{b_turn}/events", bob) == 200
        await until_opened(client, f"{TURNS}/{a_turn}/events", alice)
        stall.set()


# --- running turns: counted for the owner on the whole fleet ----------------------------------


async def started(*scripts: Script, timeout_s: float = 10) -> None:
    """Until the provider has begun answering each of ``scripts``."""
    async with asyncio.timeout(timeout_s):
        for script in scripts:
            await script.started.wait()


async def test_an_owner_past_their_running_turns_gets_429_on_every_replica(
    make_client: ClientFactory,
) -> None:
    """Three turns of alice run (a warm plain turn on one replica, a first turn and a
    background turn on the other): her fourth is 429 on both replicas, whatever it is (plain,
    streamed, background, /v1, warm or new), before the provider is called and with nothing
    kept; bob runs on; once hers end, she runs again."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    held = [Script(text="held", gate=gate) for _ in range(3)]
    api.then(Script(text="one"), Script(text="two"), *held, Script(text="bob"), Script())
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    settings: dict[str, Any] = {"owner_max_running_turns": 3, **JWT_SETTINGS}
    async with (
        make_client(provider=api.provider(), **settings) as one,
        make_client(provider=api.provider(), **settings) as two,
    ):
        first, other = [
            (await one.post(CHAT, json={"message": m}, headers=alice)).json()["conversation_id"]
            for m in ("one", "two")
        ]
        running = [
            asyncio.create_task(
                one.post(CHAT, json={"message": "warm", "conversation_id": first}, headers=alice)
            ),
            asyncio.create_task(two.post(CHAT, json={"message": "new"}, headers=alice)),
        ]
        background = await two.post(CHAT, json={"message": "bg", "background": True},
                                    headers=alice)  # fmt: skip
        assert background.status_code == 202, background.text
        await started(*held)
        calls = len(api.requests)
        for client in (one, two):
            for path, body in (
                (CHAT, {"message": "plain"}),
                (CHAT, {"message": "warm", "conversation_id": other}),
                (CHAT, {"message": "bg", "background": True}),
                (f"{CHAT}/stream", {"message": "streamed"}),
                (f"{CHAT}/stream", {"message": "warm", "conversation_id": other}),
            ):
                refused = await client.post(path, json=body, headers=alice)
                assert_error(refused, 429, "too_many_requests")  # JSON, a stream's too
                assert refused.headers["Retry-After"] == "1"
            for path, body in (
                ("/v1/responses", {"input": "hi"}),
                ("/v1/responses", {"input": "hi", "store": False}),  # a provider call all the same
                ("/v1/responses", {"input": "hi", "store": False, "stream": True}),
                ("/v1/responses/compact", {"input": "hi", "model": "gpt-test"}),
            ):
                v1 = await client.post(path, json=body, headers=alice)
                assert v1.status_code == 429, (body, v1.text)
                assert v1.json()["error"]["code"] == "too_many_requests"
                assert v1.headers["Retry-After"] == "1"
        assert len(api.requests) == calls  # the provider was not called
        kept = await one.get(f"/api/v1/conversations/{other}", headers=alice)
        assert kept.json()["revision"] == 1  # nothing kept
        assert (await two.post(CHAT, json={"message": "b"}, headers=bob)).status_code == 200
        gate.set()
        assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
        turn = await until_finished(one, background.json()["turn_id"], alice)
        assert turn["status"] == "completed", turn
        again = await two.post(CHAT, json={"message": "again"}, headers=alice)
        assert again.status_code == 200, again.text


async def test_a_turn_that_ends_without_its_commit_gives_its_place_back(
    make_client: ClientFactory,
) -> None:
    """With room for one turn, each that fails (the provider's 500, plain and streamed, new and
    warm), is filtered or cancelled leaves the room to the next at once."""
    api = FakeResponsesAPI()
    failed = Script(http_status=500, error_code="server_error")
    filtered = Script(status="incomplete", incomplete_reason="content_filter")
    api.then(Script(), failed, failed, filtered, failed, Script(gate=asyncio.Event()), Script())
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 1, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        made = await client.post(CHAT, json={"message": "first"}, headers=alice)
        warm = {"message": "again", "conversation_id": made.json()["conversation_id"]}
        assert_error(await client.post(CHAT, json={"message": "new"}, headers=alice), 502,
                     "upstream_error")  # fmt: skip
        assert_error(await client.post(CHAT, json=warm, headers=alice), 502, "upstream_error")
        assert_error(await client.post(CHAT, json=warm, headers=alice), 422, "content_filtered")
        streamed = await client.post(f"{CHAT}/stream", json=warm, headers=alice)
        assert streamed.status_code == 200 and "event: error" in streamed.text
        background = await client.post(CHAT, json={**warm, "background": True}, headers=alice)
        turn_id = background.json()["turn_id"]
        cancelled = await client.post(f"{TURNS}/{turn_id}/cancel", headers=alice)
        assert cancelled.json()["status"] == "cancelled", cancelled.text
        done = await client.post(CHAT, json=warm, headers=alice)
        assert done.status_code == 200, done.text  # not 429: every place came back


async def test_stateless_calls_hold_a_place_while_they_run_and_give_it_back(
    make_client: ClientFactory,
) -> None:
    """With room for one: a stateless call (plain, then streamed) and a relayed compaction
    each hold the place while the provider works, and leave it when they end."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    held = Script(text="held", gate=gate)
    api.then(held, Script(), Script())
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 1, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        stateless = {"input": "hi", "store": False}
        running = asyncio.create_task(client.post("/v1/responses", json=stateless, headers=alice))
        await started(held)
        refused = await client.post(CHAT, json={"message": "meanwhile"}, headers=alice)
        assert_error(refused, 429, "too_many_requests")
        gate.set()
        assert (await running).status_code == 200
        streamed = await client.post(
            "/v1/responses", json={**stateless, "stream": True}, headers=alice
        )
        assert streamed.status_code == 200 and "response.completed" in streamed.text
        compacted = await client.post("/v1/responses/compact",
                                      json={"input": "hi", "model": "gpt-test"},
                                      headers=alice)  # fmt: skip
        assert compacted.status_code == 200, compacted.text
        after = await client.post(CHAT, json={"message": "after"}, headers=alice)
        assert after.status_code == 200, after.text  # every place came back


async def test_a_streamed_turn_queued_behind_another_is_not_counted_while_it_waits(
    make_client: ClientFactory,
) -> None:
    """With room for two: a turn runs on a conversation and a background turn queues behind
    it; meanwhile the owner can still start a turn elsewhere (the queued one gave its place
    back while it waits), and the queued one runs when the first ends."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    first = Script(text="first", gate=gate)
    api.then(Script(), first, Script(text="elsewhere"), Script(text="queued"))
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 2, **JWT_SETTINGS}
    async with make_client(provider=api.provider(), **settings) as client:
        made = await client.post(CHAT, json={"message": "made"}, headers=alice)
        warm = {"message": "warm", "conversation_id": made.json()["conversation_id"]}
        running = asyncio.create_task(client.post(CHAT, json=warm, headers=alice))
        await started(first)
        queued = await client.post(CHAT, json={**warm, "background": True}, headers=alice)
        assert queued.status_code == 202, queued.text
        turn_id = queued.json()["turn_id"]
        deadline = time.monotonic() + 10
        while (elsewhere := await client.post(CHAT, json={"message": "x"}, headers=alice)
               ).status_code == 429:  # fmt: skip
            assert time.monotonic() < deadline, "the queued turn kept its place"
            await asyncio.sleep(0.02)  # until the queued turn has found the lease taken
        assert elsewhere.status_code == 200, elsewhere.text
        gate.set()
        assert (await running).status_code == 200
        assert (await until_finished(client, turn_id, alice))["status"] == "completed"


async def until_finished(
    client: httpx.AsyncClient, turn_id: str, headers: dict[str, str], timeout_s: float = 10
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (turn := (await client.get(f"{TURNS}/{turn_id}", headers=headers)).json())["status"] in (
        "queued",
        "in_progress",
    ):
        assert time.monotonic() < deadline, turn
        await asyncio.sleep(0.02)
    return dict(turn)


async def test_replicas_racing_for_the_last_places_never_run_more_than_the_limit(
    make_client: ClientFactory,
) -> None:
    """Twelve first turns of one owner at once, half on each replica, with room for four:
    exactly four reach the provider (the count is one owner's at a time in PostgreSQL, not a
    snapshot each replica reads), the others are 429, and the four commit."""
    api, gate = FakeResponsesAPI(), asyncio.Event()
    api.then(*(Script(text="raced", gate=gate) for _ in range(12)))
    alice = jwt_bearer("alice")
    settings: dict[str, Any] = {"owner_max_running_turns": 4, **JWT_SETTINGS}
    async with (
        make_client(provider=api.provider(), **settings) as one,
        make_client(provider=api.provider(), **settings) as two,
    ):
        turns = [
            asyncio.create_task(client.post(CHAT, json={"message": f"m{n}"}, headers=alice))
            for n in range(6)
            for client in (one, two)
        ]
        deadline = time.monotonic() + 20
        # Every turn either was refused or reached the provider (and waits at its gate).
        while sum(t.done() for t in turns) + len(api.requests) < len(turns):
            assert time.monotonic() < deadline, (len(api.requests), sum(t.done() for t in turns))
            await asyncio.sleep(0.02)
        assert len(api.requests) == 4
        gate.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*turns))
        assert statuses == [200] * 4 + [429] * 8


# --- memory: a request holds what it returns, not the conversation ---------------------------

MIB = 1024 * 1024


async def test_a_stateless_call_restores_from_at_most_20_conversations(
    make_client: ClientFactory, ids: Ids
) -> None:
    def named(n: int) -> dict[str, Any]:  # an item shown as one of another conversation's
        return {"type": "message", "role": "assistant", "content": "x",
                "id": ids.item(uuid.uuid4(), 1, n, None, "message")}  # fmt: skip

    async with make_client() as client:
        for count, says in ((21, "at most 20 conversations"), (20, "no stored item")):
            history = [*(named(n) for n in range(count)), {"role": "user", "content": "hi"}]
            body = {"input": history, "store": False, "model": "fake-llm"}
            refused = await client.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "input" and says in error["message"], error


# --- MAX_CONVERSATION_BYTES: a conversation holds at most so much ------------------------------

FULL_AT = 16 * 1024


async def items_of(client: httpx.AsyncClient, conversation: str) -> int:
    found = await client.get(f"/v1/conversations/{conversation}")
    assert found.status_code == 200, found.text
    listed = await client.get(f"/v1/conversations/{conversation}/items", params={"limit": 100})
    return len(listed.json()["data"])


async def test_a_turn_or_append_past_max_conversation_bytes_is_422_and_keeps_nothing(
    make_client: ClientFactory, engine: Any
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider(), max_conversation_bytes=FULL_AT) as client:
        text = "x" * 3000
        first = await client.post(CHAT, json={"message": text})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        refused = None
        for _ in range(10):  # each turn stores its message twice (text and input item)
            answer = await client.post(CHAT, json={"conversation_id": cid, "message": text})
            if answer.status_code != 200:
                refused = answer
                break
        assert refused is not None, "the conversation never filled"
        body = assert_error(refused, 422, "conversation_full")
        assert "compact" in body["message"]
        async with engine.connect() as conn:
            kept = (await conn.exec_driver_sql(
                "SELECT revision, counted_bytes, (SELECT count(*) FROM turns"
                " WHERE conversation_id = c.id) FROM conversations c WHERE id = $1",
                (uuid.UUID(cid),),
            )).one()  # fmt: skip
        revision, stored, turns = kept
        assert turns == revision and stored <= FULL_AT  # nothing of the refused turn
        calls = len(api.requests)
        # The input alone past the limit: refused before the provider is called.
        huge = await client.post(CHAT, json={"conversation_id": cid, "message": "y" * 20_000})
        assert_error(huge, 422, "conversation_full")
        assert len(api.requests) == calls
        # On /v1: a turn and an item append, in OpenAI's error shape; nothing kept.
        conv = f"conv_{uuid.UUID(cid).hex}"
        before = await items_of(client, conv)
        on_v1 = await client.post("/v1/responses", json={"conversation": conv, "input": text})
        assert on_v1.status_code == 422, on_v1.text
        assert on_v1.json()["error"]["code"] == "conversation_full"
        appended = await client.post(
            f"/v1/conversations/{conv}/items",
            json={"items": [{"role": "user", "content": text}] * 3},
        )
        assert appended.status_code == 422, appended.text
        assert await items_of(client, conv) == before
        # A new conversation is not full.
        fresh = await client.post(CHAT, json={"message": text})
        assert fresh.status_code == 200, fresh.text


async def test_a_size_an_older_release_left_behind_is_caught_up_from_the_turns_after_it(
    make_client: ClientFactory, engine: Any
) -> None:
    """The previous release commits without counting (it does not know ``stored_bytes``): a
    turn here reads only its window, so it counts the turns after ``stored_revision`` (the
    older release's) and adds them, and its commit keeps the exact total."""
    async with make_client(max_conversation_bytes=FULL_AT) as client:
        first = await client.post(CHAT, json={"message": "x" * 3000})
        cid = uuid.UUID(first.json()["conversation_id"])
        async with engine.begin() as conn:
            counted = (await conn.exec_driver_sql(
                "SELECT counted_bytes, counted_revision FROM conversations WHERE id = $1", (cid,)
            )).one()  # fmt: skip
            assert counted[1] == 1 and counted[0] > FULL_AT // 3, counted
            for seq in (2, 3):  # two turns as the previous release commits them
                await conn.exec_driver_sql(
                    "INSERT INTO turns (conversation_id, seq, user_message, assistant_message,"
                    " replay_items, created_at, status, context_from) SELECT conversation_id,"
                    " $2, user_message, assistant_message, replay_items, now(), status,"
                    " context_from FROM turns WHERE conversation_id = $1 AND seq = 1",
                    (cid, seq),
                )
            await conn.exec_driver_sql(
                "UPDATE conversations SET revision = 3 WHERE id = $1", (cid,)
            )
        refused = await client.post(CHAT, json={"conversation_id": str(cid), "message": "y"})
        assert_error(refused, 422, "conversation_full")  # 3 x the first turn passes the limit


async def test_a_size_counted_before_an_older_releases_item_removal_is_counted_again(
    make_client: ClientFactory, engine: Any
) -> None:
    """The previous release removes the latest item by moving the latest turn, without it,
    to the next revision (rewritten_at), leaving the size it does not know of behind: that
    size counts the moved turn's items already, so it is counted again whole, not added to."""
    async with make_client(max_conversation_bytes=FULL_AT) as client:
        first = await client.post(CHAT, json={"message": "x" * 1000})
        cid = uuid.UUID(first.json()["conversation_id"])
        again = await client.post(CHAT, json={"conversation_id": str(cid), "message": "y" * 1000})
        assert again.status_code == 200, again.text
        async with engine.begin() as conn:  # as the previous release's pop_item does (its
            # moved turn is a new row: without the sizes it does not know of)
            await conn.exec_driver_sql(
                "UPDATE turns SET seq = 3, replay_items = CAST(json_build_array("
                "replay_items -> 0) AS json), turn_bytes = NULL, items_bytes = NULL,"
                " opaque_bytes = NULL WHERE conversation_id = $1 AND seq = 2",
                (cid,),
            )
            await conn.exec_driver_sql(
                "UPDATE conversations SET revision = 3, rewritten_at = 3 WHERE id = $1", (cid,)
            )
        last = await client.post(CHAT, json={"conversation_id": str(cid), "message": "z"})
        assert last.status_code == 200, last.text
        async with engine.connect() as conn:
            stored = (await conn.exec_driver_sql(
                "SELECT counted_bytes FROM conversations WHERE id = $1", (cid,)
            )).scalar_one()  # fmt: skip
    whole = await PostgresStore(engine).load(cid)
    assert whole is not None and stored == held_bytes(whole.turns)


async def test_item_appends_count_a_conversation_made_by_a_fork_once_then_keep_its_size(
    make_client: ClientFactory, engine: Any
) -> None:
    """A fork's size is not counted by the statement that copies it (stored_bytes NULL): the
    first append reads its turns to count them, then every commit keeps the total, and the
    limit holds across the fork."""
    async with make_client(max_conversation_bytes=FULL_AT) as client:
        made = await client.post("/v1/conversations", json={})
        conv = made.json()["id"]
        items = f"/v1/conversations/{conv}/items"
        batch = {"items": [{"role": "user", "content": "z" * 500}] * 2}
        for _ in range(2):
            assert (await client.post(items, json=batch)).status_code == 200
        cid = uuid.UUID(conv.removeprefix("conv_"))
        forked = await client.post(f"/api/v1/conversations/{cid}/fork", json={"at_revision": 2})
        assert forked.status_code in (200, 201), forked.text
        fork_id = uuid.UUID(forked.json()["conversation_id"])

        async def stored(of: uuid.UUID) -> int | None:
            async with engine.connect() as conn:
                return (await conn.exec_driver_sql(
                    "SELECT counted_bytes FROM conversations WHERE id = $1", (of,)
                )).scalar_one()  # fmt: skip

        assert await stored(fork_id) is None
        fork_items = f"/v1/conversations/conv_{fork_id.hex}/items"
        added = await client.post(fork_items, json=batch)
        assert added.status_code == 200, added.text
        source, total = await stored(cid), await stored(fork_id)
        assert source is not None and source > 2 * 2 * 500  # two batches of two 500-byte items
        assert total == source + source // 2  # counted from its two turns, then the third
        while (added := await client.post(fork_items, json=batch)).status_code == 200:
            pass
        assert added.status_code == 422, added.text
        assert (await stored(fork_id) or 0) <= FULL_AT


# --- OWNER_MAX_FORKS_PER_MINUTE: forks counted fleet-wide, in PostgreSQL ------------------------


async def test_an_owner_past_their_forks_per_minute_gets_429_and_nothing_is_copied(
    make_client: ClientFactory, engine: Any
) -> None:
    alice, bob = jwt_bearer("alice"), jwt_bearer("bob")
    settings: dict[str, Any] = {"owner_max_forks_per_minute": 3, **JWT_SETTINGS}
    async with make_client(**settings) as client:

        async def conversations() -> int:
            async with engine.connect() as conn:
                found = await conn.exec_driver_sql("SELECT count(*) FROM conversations")
                return int(found.scalar_one())

        made = await client.post(CHAT, json={"message": "hello"}, headers=alice)
        cid = made.json()["conversation_id"]
        fork = f"/api/v1/conversations/{cid}/fork"
        for _ in range(2):
            assert (await client.post(fork, json={"at_revision": 1}, headers=alice)).is_success
        # A previous_response_id fork is a fork too: the third.
        first = await client.post("/v1/responses", json={"input": "one"}, headers=alice)
        on = {"input": "two", "previous_response_id": first.json()["id"]}
        assert (await client.post("/v1/responses", json=on, headers=alice)).is_success
        branched = await client.post("/v1/responses", json=on, headers=alice)  # r1 again: a fork
        assert branched.status_code == 200, branched.text
        before = await conversations()
        refused = await client.post(fork, json={"at_revision": 1}, headers=alice)
        assert_error(refused, 429, "too_many_requests")
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        again = await client.post("/v1/responses", json=on, headers=alice)
        assert again.status_code == 429, again.text
        assert again.json()["error"]["code"] == "too_many_requests"
        assert await conversations() == before  # nothing copied, nothing committed
        # Another owner forks on.
        theirs = await client.post(CHAT, json={"message": "hi"}, headers=bob)
        bob_fork = f"/api/v1/conversations/{theirs.json()['conversation_id']}/fork"
        assert (await client.post(bob_fork, json={"at_revision": 1}, headers=bob)).is_success
        async with engine.connect() as conn:  # the minute's record: alice 3, bob 1
            rows = await conn.exec_driver_sql(
                "SELECT owner, count(*) FROM owner_forks WHERE owner IN ('alice', 'bob')"
                " GROUP BY owner ORDER BY owner"
            )
            assert [tuple(r) for r in rows] == [("alice", 3), ("bob", 1)]


async def test_the_openapi_document_names_the_owner_limits_429(
    client: httpx.AsyncClient,
) -> None:
    """Every operation that starts a turn (or a fork) documents 429 too_many_requests."""
    paths = (await client.get("/schema/openapi.json")).json()["paths"]
    for path in (
        CHAT,
        f"{CHAT}/stream",
        "/v1/responses",
        "/api/v1/conversations/{conversation_id}/fork",
    ):
        described = paths[path]["post"]["responses"]["429"]["description"]
        assert "too_many_requests" in described, (path, described)
