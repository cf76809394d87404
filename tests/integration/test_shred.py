"""`turnstore owners shred NAME` under load, with and without encryption at rest.

The owner has turns waiting for the provider when the shred runs: a first turn (a new
conversation), a stored `/v1` response, a streamed turn of an existing conversation and a
background turn. The shred exits 0 while they still wait; then the provider answers them all.
Nothing of the owner may commit after the shred's clean exit (their tombstone is a condition
of every write), every stream ends with its one terminal event, no row of theirs is left, their
words are nowhere in the database, and the tombstones name them only by a keyed digest.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.integration.test_encryption import keys_file, served, turnstore
from tests.support.database import asyncpg_dsn
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, JWT_SETTINGS, jwt_bearer

CANARY = "canary-7f3a-do-not-keep"
OWNER = "carol"


async def dump(url: str) -> str:
    """Every row of every table of the data's database, as text."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        rows = []
        for table in tables:
            name = table["tablename"]
            rows += [f"{name}: {row}" for row in await conn.fetch(f"SELECT t::text FROM {name} t")]
        return "\n".join(rows)
    finally:
        await conn.close()


def terminal_events(stream: httpx.Response) -> list[str]:
    events = [line[7:] for line in stream.text.splitlines() if line.startswith("event: ")]
    return [name for name in events if name in ("message.done", "error")]


@pytest.mark.parametrize("encrypted", [False, True], ids=["in clear", "encrypted"])
async def test_nothing_of_a_shredded_owner_commits_after_the_shred_exits(
    database_url: str, engine: Any, tmp_path: Path, encrypted: bool
) -> None:
    keys = keys_file(tmp_path, "k1")
    settings: dict[str, Any] = dict(JWT_SETTINGS)
    env = {"DATABASE_URL": database_url}
    if encrypted:
        settings["encryption_keys_file"] = keys
        env["ENCRYPTION_KEYS_FILE"] = str(keys)
    carol, dave = jwt_bearer(OWNER), jwt_bearer("dave")
    api = FakeResponsesAPI()
    async with served(database_url, provider=api.provider(), **settings) as client:
        existing = await client.post(CHAT, json={"message": "before"}, headers=carol)
        assert existing.status_code == 200, existing.text
        cid = existing.json()["conversation_id"]
        other = await client.post(CHAT, json={"message": "dave first"}, headers=dave)
        assert other.status_code == 200, other.text
        gate = asyncio.Event()
        held = [Script(text=f"{CANARY} {n}", gate=gate) for n in range(4)]
        api.then(*held)
        in_flight = [
            client.post(CHAT, json={"message": f"{CANARY} first"}, headers=carol),
            client.post("/v1/responses", json={"model": "gpt-test", "input": f"{CANARY} stored"},
                        headers=carol),
            client.post(f"{CHAT}/stream", json={"message": f"{CANARY} streamed",
                                                "conversation_id": cid}, headers=carol),
            client.post(CHAT, json={"message": f"{CANARY} background", "background": True},
                        headers=carol),
        ]  # fmt: skip
        tasks = [asyncio.ensure_future(request) for request in in_flight]
        for script in held:
            await asyncio.wait_for(script.started.wait(), 10)  # every one waits for the provider
        shredded = await asyncio.to_thread(
            turnstore, "owners", "shred", OWNER, "--wait-s", "0", **env
        )
        assert "stopped (nothing of theirs can commit)" in shredded.stdout
        assert not any(task.done() for task in tasks[:3])  # all still wait for the provider
        gate.set()
        first, stored, streamed, background = await asyncio.gather(*tasks)
        for answer in (first, stored):
            assert answer.status_code == 404, answer.text
            assert answer.json()["error"]["code"] == "conversation_not_found"
        assert streamed.status_code == 200
        assert terminal_events(streamed) == ["error"], streamed.text
        assert json.loads(streamed.text.rsplit("data: ", 1)[1])["error"]["code"] == (
            "conversation_not_found"
        )
        assert background.status_code == 202, background.text  # it had started before
        still = await client.post(CHAT, json={"message": "dave again"}, headers=dave)
        assert still.status_code == 200, still.text  # another owner goes on
        assert held[3].started.is_set() and api.requests  # (every provider call was answered)
    everything = await dump(database_url)  # the replica has stopped: its runs have ended
    assert CANARY not in everything
    assert OWNER not in everything
    assert ("dave first" in everything) != encrypted  # the other owner's turns are there
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        assert await conn.fetchval("SELECT count(*) FROM owner_tombstones") == 1
        named = await conn.fetchval("SELECT count(*) FROM conversations WHERE owner = $1", OWNER)
        assert named == 0
        assert await conn.fetchval("SELECT count(*) FROM owner_keys WHERE owner = $1", OWNER) == 0
    finally:
        await conn.close()
