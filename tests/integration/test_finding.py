"""Finding, accounting and moving conversations (issue 35), over real HTTP on real PostgreSQL:
the listing's filters and q (in clear and under encryption, before and after a shred), the
usage totals, export and import (into a fresh database, then a turn that replays the imported
items byte for byte), and every kind of bad import refused with nothing kept."""

from __future__ import annotations

import asyncio
import json
import re
import tracemalloc
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import msgspec
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.platform import migrate
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from tests.conftest import ClientFactory
from tests.integration.test_encryption import keys_file, raw_rows, turnstore
from tests.support.database import asyncpg_dsn, fresh_database
from tests.support.helpers import JWT_SETTINGS, assert_error, jwt_bearer, serve

CHAT = "/api/v1/chat"
LIST = "/api/v1/conversations"
NDJSON = {"Content-Type": "application/x-ndjson"}
ALICE, BOB = jwt_bearer("alice"), jwt_bearer("bob")


async def say(client: httpx.AsyncClient, message: str, cid: str | None = None, **kw: Any) -> str:
    body: dict[str, Any] = {"message": message, "conversation_id": cid}
    if "model" in kw:
        body["model"] = kw.pop("model")
    answer = await client.post(CHAT, json=body, **kw)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["conversation_id"])


def plain_id(v1_id: str) -> str:
    """A /v1 conversation id as /api/v1 shows it."""
    return str(uuid.UUID(v1_id.removeprefix("conv_")))


async def found(client: httpx.AsyncClient, headers: dict[str, str], **query: str) -> list[str]:
    """Every conversation the listing finds, two a page: each once."""
    ids: list[str] = []
    after: str | None = None
    while True:
        params = {**query, "limit": "2", **({"after": after} if after else {})}
        page = await client.get(LIST, params=params, headers=headers)
        assert page.status_code == 200, page.text
        ids += [c["conversation_id"] for c in page.json()["conversations"]]
        after = page.json()["next"]
        if after is None:
            assert len(ids) == len(set(ids)), ids
            return ids


async def test_filters_page_every_match_once_and_never_another_owners(
    make_client: ClientFactory,
) -> None:
    async with make_client(**JWT_SETTINGS) as client:
        apples = [await say(client, f"Apple pie number {n}", headers=ALICE) for n in range(5)]
        pears = [await say(client, "a pear, thanks", headers=ALICE) for _ in range(3)]
        other = await say(client, "apple and pear", model="other-model", headers=ALICE)
        made = await client.post(
            "/v1/conversations", json={"metadata": {"team": "blue"}}, headers=ALICE
        )
        tagged = plain_id(made.json()["id"])
        await say(client, "an APPLE crumble", tagged, headers=ALICE)
        middle = datetime.now(UTC).isoformat()
        await asyncio.sleep(0.01)
        late = await say(client, "late apple", headers=ALICE)
        bobs = {await say(client, "apple pear", headers=BOB) for _ in range(3)}

        everything = await found(client, ALICE)
        assert len(everything) == 11 and not bobs & set(everything)
        assert set(await found(client, ALICE, q="apple")) == {*apples, other, tagged, late}
        assert set(await found(client, ALICE, q="PEAR apple")) == {other}
        assert set(await found(client, ALICE, q="pear")) == {*pears, other}
        assert await found(client, ALICE, q="appl") == []  # whole words
        assert await found(client, ALICE, model="other-model") == [other]
        assert await found(client, ALICE, **{"metadata[team]": "blue"}) == [tagged]
        assert await found(client, ALICE, **{"metadata[team]": "red"}) == []
        both = {"metadata[team]": "blue", "q": "crumble"}
        assert await found(client, ALICE, **both) == [tagged]
        assert await found(client, ALICE, created_after=middle) == [late]
        assert set(await found(client, ALICE, created_before=middle)) == set(everything) - {late}
        assert set(await found(client, ALICE, updated_after=middle)) == {late}
        assert set(await found(client, BOB, q="apple")) == bobs

        for query, param in (
            ({"colour": "red"}, "colour"),
            ({"created_after": "yesterday"}, "created_after"),
            ({"updated_before": "2026-01-01"}, "updated_before"),
            ({"after": "not-a-cursor"}, "after"),
            ({"q": "  ,,  "}, "q"),
        ):
            refused = await client.get(LIST, params=query, headers=ALICE)
            assert param in assert_error(refused, 400, "invalid_input")["message"], query


async def test_usage_sums_the_committed_turns_usage(make_client: ClientFactory) -> None:
    async with make_client(**JWT_SETTINGS) as client:
        one = await say(client, "first", headers=ALICE)
        await say(client, "second", one, headers=ALICE)
        two = await say(client, "third", model="m2", headers=ALICE)
        await say(client, "bob's", headers=BOB)
        turns = []
        for cid in (one, two):
            page = (await client.get(f"{LIST}/{cid}", headers=ALICE)).json()
            turns += [turn["usage"] for turn in page["turns"]]
        by = {}
        for group in ("day", "model", "conversation"):
            answer = await client.get("/api/v1/usage", params={"group_by": group}, headers=ALICE)
            assert answer.status_code == 200, answer.text
            by[group] = answer.json()
        total = by["day"]["total"]
        assert total["turns"] == 3 == len(turns)
        assert total["input_tokens"] == sum(u["input_tokens"] for u in turns)
        assert total["output_tokens"] == sum(u["output_tokens"] for u in turns)
        assert total["reasoning_tokens"] == sum(
            u["output_tokens_details"]["reasoning_tokens"] for u in turns
        )
        assert all(by[group]["total"] == total for group in by)
        assert {line["key"]: line["turns"] for line in by["conversation"]["data"]} == {
            one: 2,
            two: 1,
        }
        assert "m2" in {line["key"] for line in by["model"]["data"]}
        for edge in ({"to": "0001-01-05T00:00:00Z"},  # the default from is year 1's first day
                     {"from": "9999-12-30T00:00:00Z", "to": "9999-12-31T00:00:00Z"}):  # fmt: skip
            empty = await client.get("/api/v1/usage", params=edge, headers=ALICE)
            assert empty.status_code == 200 and empty.json()["data"] == [], empty.text  # not 500
        refused = await client.get("/api/v1/usage", params={"from": "2020-01-01T00:00:00Z"},
                                   headers=ALICE)  # fmt: skip
        assert_error(refused, 400, "invalid_input")


async def test_search_under_encryption_matches_digests_and_nothing_after_a_shred(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    keys = keys_file(tmp_path, "k1")
    settings = {"encryption_keys_file": keys, **JWT_SETTINGS}
    config = Settings(database_url=database_url, **settings)
    async with (
        serve(create_app(config, provider=FakeProvider())) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        zebra = await say(client, "Zebrafinch secret", headers=ALICE)
        made = await client.post(
            "/v1/conversations", json={"metadata": {"project": "okapi"}}, headers=ALICE
        )
        okapi = plain_id(made.json()["id"])
        bobs = await say(client, "zebrafinch too", headers=BOB)
        assert await found(client, ALICE, q="zebrafinch") == [zebra]
        assert await found(client, ALICE, **{"metadata[project]": "okapi"}) == [okapi]
        assert await found(client, BOB, q="ZEBRAFINCH") == [bobs]
        dump = await raw_rows(engine)
        assert "zebrafinch" not in dump.lower() and "okapi" not in dump
        async with engine.connect() as conn:
            before: str = await conn.scalar(
                text("SELECT CAST(search AS text) FROM conversations WHERE id = :id"),
                {"id": zebra},
            )
        env = {"DATABASE_URL": database_url, "ENCRYPTION_KEYS_FILE": str(keys)}
        shred = ["owners", "shred", "alice", "--wait-s", "0"]
        done = await asyncio.to_thread(turnstore, *shred, **env)
        assert done.returncode == 0, done.stderr
        assert await found(client, ALICE, q="zebrafinch") == []
        assert await found(client, BOB, q="zebrafinch") == [bobs]
        # What the backup held of alice's terms is digests under a key that is gone: no
        # owner's digest of the word is any of them.
        again = await say(client, "zebrafinch secret", headers=jwt_bearer("carol"))
        async with engine.connect() as conn:
            now: str = await conn.scalar(
                text("SELECT CAST(search AS text) FROM conversations WHERE id = :id"),
                {"id": again},
            )
        words = [set(t for t in terms.split() if t.startswith("'_w")) for terms in (before, now)]
        assert words[0] and words[1] and not words[0] & words[1]


def lines_of(body: bytes) -> list[dict[str, Any]]:
    return [msgspec.json.decode(line) for line in body.splitlines() if line]


async def test_export_then_import_into_a_fresh_database_then_a_turn_replays_the_items(
    make_client: ClientFactory, database: str
) -> None:
    async with make_client() as client:
        cid = await say(client, "remember the rose")
        await say(client, "and the thorn", cid)
        exported = await client.get(f"{LIST}/{cid}/export")
        assert exported.status_code == 200, exported.text
        assert exported.headers["content-type"].startswith("application/x-ndjson")
    head, *turns = lines_of(exported.content)
    assert head["id"] == cid and head["revision"] == 2 and len(turns) == 2
    assert turns[1]["replay_items"][1]["type"] == "reasoning"
    made_by = {"provider": "fake", "endpoint": "builtin", "model": "fake-llm", "kind": "fake"}
    assert turns[1]["origin"] == made_by  # the whole origin (a key's fingerprint: none here)
    fresh = database
    app = create_app(Settings(database_url=fresh), provider=FakeProvider())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as other:
        made = await other.post(f"{LIST}/import", content=exported.content, headers=NDJSON)
        assert made.status_code == 201, made.text
        moved = made.json()["conversation_id"]
        assert made.json()["revision"] == 2 and made.headers["etag"] == '"2"'
        again = await other.get(f"{LIST}/{moved}/export")
        head2, *turns2 = lines_of(again.content)
        assert head2["revision"] == 2 and head2["id"] == moved
        for key in ("replay_items", "origin", "messages", "usage", "revision"):
            assert [t[key] for t in turns2] == [t[key] for t in turns], key
        items = [line.split(b'"replay_items":', 1)[1] for line in again.content.splitlines()[1:]]
        assert items == [
            line.split(b'"replay_items":', 1)[1] for line in exported.content.splitlines()[1:]
        ]  # byte for byte
        # The fake checks its own sealed reasoning: a changed byte would fail the turn.
        reply = await other.post(CHAT, json={"message": "what was it?", "conversation_id": moved})
        assert reply.status_code == 200, reply.text
        assert reply.json()["message"].endswith("(history=4)")
        assert reply.json()["revision"] == 3
        engine = create_engine(fresh, pool_size=1)
        try:
            async with engine.connect() as conn:
                kept = await conn.scalar(text("SELECT count(*) FROM turns"))
        finally:
            await engine.dispose()
        assert kept == 3


def big_export(turns: int, text_bytes: int) -> bytes:
    when = datetime.now(UTC).isoformat()
    head = {"id": "x", "metadata": {}, "created_at": when, "updated_at": when,
            "revision": turns, "window_start": 1}  # fmt: skip
    out = [msgspec.json.encode(head)]
    for n in range(1, turns + 1):
        said = "w" * text_bytes
        out.append(
            msgspec.json.encode(
                {
                    "revision": n,
                    "created_at": when,
                    "messages": [
                        {"role": "user", "content": said},
                        {"role": "assistant", "content": "ok"},
                    ],
                    "replay_items": [{"type": "message", "role": "user", "content": said}],
                }
            )
        )
    return b"\n".join(out) + b"\n"


async def test_an_export_of_a_large_conversation_holds_a_page_not_the_conversation(
    make_client: ClientFactory,
) -> None:
    body = big_export(120, 100_000)  # about 24 MB stored
    async with make_client() as client:
        made = await client.post(f"{LIST}/import", content=body, headers=NDJSON)
        assert made.status_code == 201, made.text
        cid = made.json()["conversation_id"]
        tracemalloc.start()
        try:
            size = 0
            async with client.stream("GET", f"{LIST}/{cid}/export") as exported:
                async for chunk in exported.aiter_raw():
                    size += len(chunk)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert size > 24_000_000
    assert peak < 8_000_000, peak  # a page of turns (4) and the client's chunks, not 24 MB


CHAT_UNREAD = b'"replay_items":[{"role":"assistant","tool_calls":"x"},'
GEMINI_UNREAD = b'"replay_items":[{"text":"a","thought":"yes"},'
TOO_MANY_PAIRS = b'"metadata":' + json.dumps({f"k{n}": "v" for n in range(17)}).encode()
HUGE = b'"input_tokens":1152921504606846976'


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (lambda ls: [b"{not json", *ls[1:]], 1),
        (lambda ls: [ls[0], ls[1].replace(b'"revision":1', b'"revision":1,"extra":1'), *ls[2:]], 2),
        (lambda ls: [ls[0], ls[2], ls[1]], 3),  # revisions out of order
        (lambda ls: [ls[0], ls[1], ls[1]], 3),  # a revision twice
        (lambda ls: [ls[0], ls[1]], 2),  # ends before the conversation's revision
        (lambda ls: [ls[0], b"[1, 2]", ls[2]], 2),
        (lambda ls: [ls[0], ls[1].replace(b'"content":"', b'"content":"\\u0000', 1), ls[2]], 2),
        (lambda ls: [ls[0], ls[1].replace(b'"role":"user"', b'"role":"system"'), ls[2]], 2),
        (lambda ls: [ls[0], ls[1], ls[2].replace(b'"replay_items":[', b'"replay_items":[1,')], 3),
        (lambda ls: [ls[0], ls[1], b'{"revision":2,' + b'"x":"' + b"y" * 2_000_000 + b'"}'], 3),
        # What a form cannot read (a turn over it would fail for good), a Chat's and a Gemini's:
        (lambda ls: [*ls[:2], ls[2].replace(b'"replay_items":[', CHAT_UNREAD)], 3),
        (lambda ls: [*ls[:2], ls[2].replace(b'"replay_items":[', GEMINI_UNREAD)], 3),
        (lambda ls: [re.sub(rb'"window_start":\d+', b'"window_start":50', ls[0]), *ls[1:]], 1),
        (lambda ls: [ls[0].replace(b'"metadata":{}', TOO_MANY_PAIRS), *ls[1:]], 1),
        (lambda ls: [ls[0], re.sub(rb'"input_tokens":\d+', HUGE, ls[1]), ls[2]], 2),
    ],
)
async def test_every_kind_of_bad_import_line_is_refused_naming_it_and_nothing_is_kept(
    make_client: ClientFactory, engine: AsyncEngine, edit: Any, line: int
) -> None:
    async with make_client() as client:
        cid = await say(client, "one")
        await say(client, "two", cid)
        good = (await client.get(f"{LIST}/{cid}/export")).content.splitlines()
        async with engine.connect() as conn:
            before = await conn.scalar(text("SELECT count(*) FROM conversations"))
        body = b"\n".join(edit(good)) + b"\n"
        refused = await client.post(f"{LIST}/import", content=body, headers=NDJSON)
        assert f"Line {line} " in assert_error(refused, 400, "invalid_input")["message"]
        async with engine.connect() as conn:
            assert await conn.scalar(text("SELECT count(*) FROM conversations")) == before
        wrong = await client.post(
            f"{LIST}/import", content=b"\n".join(good), headers={"Content-Type": "application/json"}
        )
        assert wrong.status_code in (400, 415), wrong.text


async def test_an_import_over_the_limits_is_refused_as_a_turn_would_be_and_honours_its_key(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    body = big_export(3, 1000)
    async with make_client(max_conversation_bytes=1024, max_body_bytes=2100) as client:
        refused = await client.post(f"{LIST}/import", content=body, headers=NDJSON)
        assert_error(refused, 413, "payload_too_large")
    async with make_client(max_conversation_bytes=5000) as client:
        full = await client.post(f"{LIST}/import", content=body, headers=NDJSON)
        assert_error(full, 422, "conversation_full")
    async with make_client() as client:
        key = {**NDJSON, "Idempotency-Key": "import-1"}
        first = await client.post(f"{LIST}/import", content=body, headers=key)
        second = await client.post(f"{LIST}/import", content=body, headers=key)
        assert first.status_code == second.status_code == 201, second.text
        assert first.json()["conversation_id"] == second.json()["conversation_id"]
        other = await client.post(f"{LIST}/import", content=big_export(2, 10), headers=key)
        assert_error(other, 422, "idempotency_key_reused")
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT count(*) FROM conversations")) == 1


async def test_owners_export_writes_every_conversation_of_the_owner_and_no_other(
    make_client: ClientFactory, database_url: str
) -> None:
    async with make_client(**JWT_SETTINGS) as client:
        first = await say(client, "one", headers=ALICE)
        await say(client, "two", first, headers=ALICE)
        second = await say(client, "three", headers=ALICE)
        await say(client, "bob's", headers=BOB)
    done = await asyncio.to_thread(
        turnstore, "owners", "export", "alice", DATABASE_URL=database_url
    )
    assert done.returncode == 0, done.stderr
    lines = lines_of(done.stdout.encode())
    heads = [line["id"] for line in lines if line.get("object") == "conversation"]
    assert heads == [second, first]  # newest first, each followed by its turns
    assert [line.get("revision") for line in lines] == [1, 1, 2, 1, 2]
    assert "exported 2 conversations" in done.stderr


def test_the_migrations_backfill_finds_what_was_written_before_it(server_url: str) -> None:
    """Conversations written before 0021 (a transcript, a model, metadata) are found by the
    terms its backfill computed in SQL, as the code would have computed them: a word, the
    model and a metadata pair."""
    with fresh_database(server_url) as url:
        migrate.upgrade(url, "0020")
        cid = uuid.uuid4()
        asyncio.run(_written_at_0020(url, cid))
        migrate.upgrade(url)
        asyncio.run(_found_after(url, cid))


async def _written_at_0020(url: str, cid: uuid.UUID) -> None:
    before = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await before.execute(
            "INSERT INTO conversations (id, revision, created_at, updated_at, context_start,"
            " owner, lease_wanted, metadata) VALUES ($1, 1, now(), now(), 1, 'anonymous',"
            ' false, \'{"team": "blüe"}\')',
            cid,
        )
        await before.execute(
            "INSERT INTO turns (conversation_id, seq, created_at, user_message,"
            " assistant_message, replay_items, provider, endpoint, model, transcript)"
            " VALUES ($1, 1, now(), 'Where is the Lighthouse?', 'By the sea.', '[]',"
            " 'openai', 'e', 'gpt-old', '[[\"user\", \"Where is the Lighthouse?\"],"
            ' ["tool", "Fathoms deep"]]\')',
            cid,
        )
    finally:
        await before.close()


async def _found_after(url: str, cid: uuid.UUID) -> None:
    app = create_app(Settings(database_url=url), provider=FakeProvider())
    async with serve(app) as base, httpx.AsyncClient(base_url=base) as client:
        queries = [{"q": "lighthouse"}, {"q": "FATHOMS"}, {"model": "gpt-old"}]
        for query in [*queries, {"metadata[team]": "blüe"}]:
            assert await found(client, {}, **query) == [str(cid)], query
        assert await found(client, {}, q="harbour") == []
        assert await found(client, {}, **{"metadata[team]": "red"}) == []


async def test_an_erased_response_is_found_by_none_of_its_words(
    make_client: ClientFactory,
) -> None:
    """DELETE of a stored response outside any conversation of its client erases what only it
    held: a search for one of its words finds nothing afterwards (its words stayed among the
    terms of the conversation that held it, which a search still found)."""
    async with make_client() as client:
        made = await client.post(
            "/v1/responses", json={"model": "fake-llm", "input": "my zebra42 passport"}
        )
        assert made.status_code == 200, made.text
        assert len(await found(client, {}, q="zebra42")) == 1
        erased = await client.delete(f"/v1/responses/{made.json()['id']}")
        assert erased.status_code == 200, erased.text
        assert await found(client, {}, q="zebra42") == []


@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "encrypted"])
async def test_a_removed_item_is_found_by_none_of_its_words(
    database: str, tmp_path: Path, encrypted: bool
) -> None:
    """DELETE .../items/{latest} takes its words out of the conversation's search terms (they
    stayed, so a search for a removed secret still found the conversation); the words of what
    it still holds, and its metadata, find it as before."""
    keys = {"encryption_keys_file": keys_file(tmp_path, "k1")} if encrypted else {}
    config = Settings(database_url=database, **keys, **JWT_SETTINGS)
    async with (
        serve(create_app(config, provider=FakeProvider())) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        made = await client.post(
            "/v1/conversations",
            json={"metadata": {"team": "okapi"}, "items": [{"role": "user", "content": "kept"}]},
            headers=ALICE,
        )
        conv = made.json()["id"]
        added = await client.post(
            f"/v1/conversations/{conv}/items",
            json={"items": [{"role": "user", "content": "my zebra42 passport"}]},
            headers=ALICE,
        )
        assert added.status_code == 200, added.text
        assert await found(client, ALICE, q="zebra42") == [plain_id(conv)]
        latest = added.json()["data"][-1]["id"]
        removed = await client.delete(f"/v1/conversations/{conv}/items/{latest}", headers=ALICE)
        assert removed.status_code == 200, removed.text
        assert await found(client, ALICE, q="zebra42") == []
        assert await found(client, ALICE, q="kept") == [plain_id(conv)]
        assert await found(client, ALICE, **{"metadata[team]": "okapi"}) == [plain_id(conv)]
