"""The previous release and this one side by side on this release's schema, as a rolling
upgrade leaves them: two real processes on one database (built by the previous release's
`turnstore db upgrade`, then migrated by this release's), one provider (the fake Responses
API over HTTP, which records what each turn sent).

Every cross-version behaviour a client can meet, in both directions (the first replica is
the one a client used before, the second the one its next request lands on):
alternating turns, a stale If-Match, an Idempotency-Key claimed on one and retried on the
other (while running and once done), a history cache after the other rewrote it, a `/v1`
conversation made on one and continued on the other, a delete. Today the previous release
and this one differ in no schema, so this guards what comes: a release whose migrations or
code break one of these fails here.
"""

from __future__ import annotations

import asyncio
import base64
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.support.cluster import (
    TURNSTORE,
    fake_api,
    process,
    provider_env,
    replica,
    turnstore_env,
    wait_ready,
)
from tests.support.database import asyncpg_dsn, fresh_database
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import assert_error
from tests.support.previous_release import Release

CHAT = "/api/v1/chat"


@pytest.fixture
def migrated(server_url: str, previous_release: Release) -> Iterator[str]:
    with fresh_database(server_url) as url:
        built = previous_release.run("db", "upgrade", DATABASE_URL=url)
        assert built.returncode == 0, built.stderr
        yield url


@asynccontextmanager
async def side_by_side(
    url: str, release: Release, tmp_path: Path, api: FakeResponsesAPI, **more: str
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """This release migrates, then both serve with the settings ``more``: (previous, this)."""
    env = turnstore_env(DATABASE_URL=url)
    with process([TURNSTORE, "db", "upgrade"], tmp_path / "upgrade.log", env) as up:
        assert await up.wait(60) == 0, up.tail()
    async with fake_api(api) as base_url:
        settings = {"DATABASE_URL": url, **provider_env(base_url), **more}
        with (
            release.serve(tmp_path / "previous.log", **settings) as old,
            replica(turnstore_env(**settings), tmp_path / "this.log") as new,
        ):
            await asyncio.gather(wait_ready(old), wait_ready(new))
            async with (
                httpx.AsyncClient(base_url=old.url, timeout=30) as previous,
                httpx.AsyncClient(base_url=new.url, timeout=30) as this,
            ):
                yield previous, this


def _texts(value: Any) -> list[str]:
    """Every text in a provider request's input, in order."""
    if isinstance(value, dict):
        found = [value["text"]] if isinstance(value.get("text"), str) else []
        if isinstance(value.get("content"), str):
            found.append(value["content"])
        return found + [t for k, v in value.items() if k != "text" for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def _said(api: FakeResponsesAPI) -> list[str]:
    """The texts of the last provider request's input."""
    return _texts(api.requests[-1]["input"])


async def _chat(
    client: httpx.AsyncClient, message: str, cid: str | None = None, **headers: str
) -> httpx.Response:
    body: dict[str, Any] = {"message": message}
    if cid:
        body["conversation_id"] = cid
    return await client.post(CHAT, json=body, headers=headers)


async def alternating_turns(
    a: httpx.AsyncClient, b: httpx.AsyncClient, api: FakeResponsesAPI
) -> str:
    first = await _chat(a, "t1")
    assert first.status_code == 200, first.text
    cid = first.json()["conversation_id"]
    for number, client in enumerate([b, a, b], start=2):
        turn = await _chat(client, f"t{number}", cid)
        assert turn.status_code == 200, turn.text
        assert turn.json()["revision"] == number
        # Each replica sent the whole history, whoever wrote it.
        assert [t for t in _said(api) if t.startswith("t")] == [
            f"t{n}" for n in range(1, number + 1)
        ]
    read_a = (await a.get(f"/api/v1/conversations/{cid}")).json()
    read_b = (await b.get(f"/api/v1/conversations/{cid}")).json()
    assert read_a["messages"] == read_b["messages"] and read_a["revision"] == 4
    return str(cid)


async def stale_if_match(a: httpx.AsyncClient, b: httpx.AsyncClient, cid: str) -> None:
    revision = (await a.get(f"/api/v1/conversations/{cid}")).json()["revision"]
    ahead = await _chat(a, "fresh", cid, **{"If-Match": f'"{revision}"'})
    assert ahead.status_code == 200 and ahead.headers["etag"] == f'"{revision + 1}"'
    assert_error(
        await _chat(b, "stale", cid, **{"If-Match": f'"{revision}"'}), 412, "precondition_failed"
    )
    fresh = await _chat(b, "fresh again", cid, **{"If-Match": f'"{revision + 1}"'})
    assert fresh.status_code == 200 and fresh.json()["revision"] == revision + 2


async def key_across_versions(
    a: httpx.AsyncClient, b: httpx.AsyncClient, api: FakeResponsesAPI
) -> None:
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    gate = asyncio.Event()
    script = Script(gate=gate)
    api.then(script)
    calls = len(api.requests)
    claimed = asyncio.create_task(_chat(a, "keyed", **key))
    await asyncio.wait_for(script.started.wait(), 30)
    assert_error(await _chat(b, "keyed", **key), 409, "request_in_progress")
    gate.set()
    first = await claimed
    assert first.status_code == 200, first.text
    again = await _chat(b, "keyed", **key)
    assert again.status_code == 200, again.text
    for field in ("conversation_id", "revision", "message", "status"):
        assert again.json()[field] == first.json()[field], field
    assert len(api.requests) == calls + 1  # the provider ran once
    assert_error(await _chat(b, "another body", **key), 422, "idempotency_key_reused")
    cid = first.json()["conversation_id"]
    assert (await a.get(f"/api/v1/conversations/{cid}")).json()["revision"] == 1


async def _respond(client: httpx.AsyncClient, conversation: str, text: str) -> dict[str, Any]:
    answer = await client.post("/v1/responses", json={"conversation": conversation, "input": text})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def cache_after_a_rewrite(
    a: httpx.AsyncClient, b: httpx.AsyncClient, api: FakeResponsesAPI
) -> None:
    """b holds the history in its cache; a removes the latest item; b's next turn must not
    send the removed item."""
    made = await b.post("/v1/conversations", json={})
    conversation = made.json()["id"]
    await _respond(b, conversation, "one")
    await _respond(b, conversation, "two")
    items = (
        await a.get(f"/v1/conversations/{conversation}/items", params={"order": "desc"})
    ).json()
    latest = items["data"][0]
    removed = _texts(latest)
    assert latest["type"] == "message" and latest["role"] == "assistant" and removed
    gone = await a.delete(f"/v1/conversations/{conversation}/items/{latest['id']}")
    assert gone.status_code == 200, gone.text
    await _respond(b, conversation, "three")
    sent = _said(api)
    assert "one" in sent and "two" in sent and "three" in sent
    assert not set(removed) & set(sent), (removed, sent)


async def v1_conversation_continued(a: httpx.AsyncClient, b: httpx.AsyncClient) -> None:
    made = await a.post("/v1/conversations", json={"metadata": {"topic": "upgrades"}})
    assert made.status_code == 200, made.text
    conversation = made.json()["id"]
    await _respond(b, conversation, "hello from the other version")
    await _respond(a, conversation, "and back")
    cid = str(uuid.UUID(conversation.removeprefix("conv_")))
    for client in (a, b):
        read = (await client.get(f"/api/v1/conversations/{cid}")).json()
        assert read["revision"] == 2
        meta = (await client.get(f"/v1/conversations/{conversation}")).json()["metadata"]
        assert meta == {"topic": "upgrades"}


async def delete_across_versions(a: httpx.AsyncClient, b: httpx.AsyncClient) -> None:
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    keyed = await _chat(a, "to be deleted", **key)
    cid = keyed.json()["conversation_id"]
    async with aconnect_sse(
        a, "POST", "/api/v1/chat/stream", json={"message": "streamed", "conversation_id": cid}
    ) as source:
        turn_id = source.response.headers["x-turn-id"]
        names = [event.event async for event in source.aiter_sse()]
    assert names[-1] == "message.done"
    assert (await b.get(f"/api/v1/turns/{turn_id}/events", params={"after": 0})).status_code == 200
    assert (await b.delete(f"/api/v1/conversations/{cid}")).status_code == 204
    for client in (a, b):
        assert_error(
            await client.get(f"/api/v1/conversations/{cid}"), 404, "conversation_not_found"
        )
        assert_error(await _chat(client, "more", cid), 404, "conversation_not_found")
        assert_error(await client.get(f"/api/v1/turns/{turn_id}"), 404, "turn_not_found")
    # The key went with its conversation: a retry runs anew, it does not answer deleted text.
    retried = await _chat(a, "to be deleted", **key)
    assert retried.status_code == 200 and retried.json()["conversation_id"] != cid


@pytest.mark.parametrize(
    ("first", "encrypted"), [("previous", False), ("this", False), ("previous", True)]
)
async def test_the_previous_release_and_this_one_side_by_side(
    migrated: str, previous_release: Release, tmp_path: Path, first: str, encrypted: bool
) -> None:
    more = {}
    if encrypted:  # both hold the same master key: each reads what the other sealed
        keys = tmp_path / "master.keys"
        keys.write_text(f"m1:{base64.b64encode(os.urandom(32)).decode()}\n")
        more["ENCRYPTION_KEYS_FILE"] = str(keys)
    api = FakeResponsesAPI()
    async with side_by_side(migrated, previous_release, tmp_path, api, **more) as (old, new):
        a, b = (old, new) if first == "previous" else (new, old)
        cid = await alternating_turns(a, b, api)
        await stale_if_match(a, b, cid)
        await key_across_versions(a, b, api)
        await cache_after_a_rewrite(a, b, api)
        await v1_conversation_continued(a, b)
        await delete_across_versions(a, b)
    if encrypted:  # a replica writing around the encryption would leave turns in clear
        clear, sealed = await _turns_by_kind(migrated)
        assert clear == 0 and sealed > 0, (clear, sealed)


async def _turns_by_kind(url: str) -> tuple[int, int]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        row = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE sealed_replay_items IS NULL),"
            " count(*) FILTER (WHERE sealed_replay_items IS NOT NULL) FROM turns"
        )
        return int(row[0]), int(row[1])
    finally:
        await conn.close()
