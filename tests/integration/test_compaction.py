"""Compaction over PostgreSQL: tests/contracts/compaction.py, and what only the rows show (a failed compaction keeps nothing, compaction items sealed at rest, a restart)."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.contracts.compaction import *  # noqa: F403
from tests.contracts.compaction import COMPACT_AT_ONCE, kinds, said
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, sdk, snapshot


@pytest.mark.parametrize("failing", ["compaction", "turn"])
async def test_a_compacting_turn_that_fails_keeps_nothing(
    database_url: str, engine: AsyncEngine, failing: str
) -> None:
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider()) as (client, _, _plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="one")
        before = await snapshot(engine)
        broken = Script(http_status=500)
        api.then(broken) if failing == "compaction" else api.then(Script(), broken)
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(
                conversation=conversation.id, input="two", context_management=COMPACT_AT_ONCE
            )
        assert await snapshot(engine) == before
        async with engine.connect() as conn:
            kept = await conn.scalar(text("SELECT count(*) FROM turns WHERE compacted IS NOT NULL"))
        assert kept == 0
        again = await client.responses.create(
            conversation=conversation.id, input="two", context_management=COMPACT_AT_ONCE
        )
    assert again.output[0].type == "compaction"  # compacted anew, and kept


async def test_the_builtin_fake_proves_compaction_and_a_restart_keeps_the_window_start(
    make_client: Any, engine: AsyncEngine
) -> None:
    """CONTEXT_STRATEGY=compact on /api/v1: the fake's reply says how many items the
    compaction item it got back stands for; the window start never moves back."""
    settings = {"context_strategy": "compact", "compact_threshold_tokens": 60}
    async with make_client(**settings) as client:
        made = await client.post(CHAT, json={"message": "one"})
        cid = made.json()["conversation_id"]
        replies = [made.json()["message"]]
        for word in ("two", "three", "four"):
            answer = await client.post(CHAT, json={"message": word, "conversation_id": cid})
            assert answer.status_code == 200, answer.text
            replies.append(answer.json()["message"])
    assert replies[0] == "[fake-llm] one"
    compacted = [r for r in replies if "compacted=" in r]
    assert compacted, replies  # the threshold was passed
    async with engine.connect() as conn:
        starts = (
            await conn.execute(
                text("SELECT seq, context_from, compacted IS NOT NULL FROM turns "
                     "WHERE conversation_id = :cid ORDER BY seq"), {"cid": uuid.UUID(cid)},
            )
        ).all()  # fmt: skip
    latest = max(seq for seq, _, made_one in starts if made_one)
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(starts))
    # Another process (a restart) with the default strategy: it starts at the compaction.
    async with make_client() as client:
        later = await client.post(CHAT, json={"message": "five", "conversation_id": cid})
        read = (await client.get(f"/api/v1/conversations/{cid}")).json()
    assert later.status_code == 200, later.text
    assert "compacted=" in later.json()["message"]  # the compaction item went back, unbroken
    assert read["context_start"] == latest
    assert [m["content"] for m in read["messages"][::2]] == ["one", "two", "three", "four", "five"]


async def test_responses_compact_is_relayed_and_keeps_nothing(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider()) as (client, _, plain):
        first = await client.responses.create(input="one")
        before = await snapshot(engine)
        # The SDK's own compact type refuses user messages in output under strict
        # validation (as against OpenAI): read the answer as JSON.
        raw = await plain.post(
            "/v1/responses/compact", json={"model": "gpt-test", "previous_response_id": first.id}
        )
        assert raw.status_code == 200, raw.text
        body = raw.json()
        assert body["object"] == "response.compaction" and isinstance(body["created_at"], int)
        assert [i.get("type", "message") for i in body["output"]] == ["message", "compaction"]
        assert body["usage"]["total_tokens"] == 15
        assert await snapshot(engine) == before
        sent = api.requests[-1]
        assert said(sent) == ["one"] and kinds(sent) == ["message", "reasoning", "message"]
        on_input = await plain.post(
            "/v1/responses/compact", json={"model": "gpt-test", "input": "just this"}
        )
        assert on_input.status_code == 200 and said(api.requests[-1]) == ["just this"]
        gone = await plain.post(
            "/v1/responses/compact", json={"model": "gpt-test", "previous_response_id": "resp_x"}
        )
        assert gone.status_code == 400
        assert gone.json()["error"]["code"] == "previous_response_not_found"
        # What it answered goes back as input, as OpenAI's clients send it.
        answer = await client.responses.create(
            input=[*body["output"], {"role": "user", "content": "two"}], model="gpt-test"
        )
    assert kinds(api.requests[-1]) == ["message", "compaction", "message"]
    assert answer.status == "completed"


async def test_compaction_items_are_sealed_at_rest(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1:" + "A" * 43 + "=\n")
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider(), encryption_keys_file=keys) as (client, _, _):
        conversation = await client.conversations.create()
        for word in ("one", "two", "three"):
            await client.responses.create(
                conversation=conversation.id, input=word, context_management=COMPACT_AT_ONCE
            )
    assert kinds(api.requests[-1])[-2:] == ["compaction", "message"]  # it went back, opened
    async with engine.connect() as conn:
        rows = await conn.scalar(
            text("SELECT string_agg(CAST(t AS text), ' ') FROM turns t WHERE compacted IS NULL")
        )
        sealed = await conn.scalar(
            text("SELECT count(*) FROM turns WHERE sealed_compacted IS NOT NULL")
        )
    assert sealed == 2 and "gAAA-compacted" not in rows and "cmp_" not in rows
