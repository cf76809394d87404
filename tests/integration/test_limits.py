"""Owner limits over PostgreSQL: tests/contracts/limits.py, and the stored sizes as the rows keep them (older releases' sizes, forks, appends)."""

from __future__ import annotations

import uuid
from typing import Any

from service.core.sizes import held_bytes
from service.store.postgres import PostgresStore
from tests.conftest import ClientFactory
from tests.contracts.limits import *  # noqa: F403
from tests.contracts.limits import FULL_AT, items_of
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer


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
    whole = await PostgresStore.over(engine).history.load(cid)
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
