"""Compaction racing other writers on two `turnstore serve` replicas."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

from tests.integration.test_compaction import kinds, said
from tests.support.cluster import replicas
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT


async def test_a_compacting_turn_racing_other_writers_on_two_replicas_loses_nothing(
    database: str, tmp_path: Path
) -> None:
    """While replica A's turn compacts (its compaction call held open), replica B's plain
    turn and item append are refused with nothing kept; A commits; then B's turn runs on the
    compacted context, and every committed item is still listed."""
    api = FakeResponsesAPI()
    settings = {"CONTEXT_STRATEGY": "compact", "COMPACT_THRESHOLD_TOKENS": "1"}
    async with replicas(database, tmp_path, api, **settings) as (a, b):
        first = await a.post(CHAT, json={"message": "one"})
        cid = first.json()["conversation_id"]
        gate = asyncio.Event()
        held = Script(gate=gate)
        api.then(held)
        racing = asyncio.ensure_future(
            a.post(CHAT, json={"message": "two", "conversation_id": cid})
        )
        await held.started.wait()
        assert api.urls[-1].endswith("/responses/compact")
        busy = await b.post(CHAT, json={"message": "not now", "conversation_id": cid})
        assert busy.status_code == 409, busy.text
        item = {"type": "message", "role": "user", "content": "appended"}
        appended = await b.post(f"/v1/conversations/conv_{uuid.UUID(cid).hex}/items",
                                json={"items": [item]})  # fmt: skip
        assert appended.status_code == 409, appended.text
        gate.set()
        won = await racing
        assert won.status_code == 200 and won.json()["revision"] == 2, won.text
        after = await b.post(CHAT, json={"message": "three", "conversation_id": cid})
        assert after.status_code == 200, after.text
        listed = await b.get(
            f"/v1/conversations/conv_{uuid.UUID(cid).hex}/items", params={"order": "asc"}
        )
    # B's turn compacted again (the threshold is 1): the kept user messages, the compaction
    # item, its own message.
    assert kinds(api.requests[-1]) == ["message", "message", "compaction", "message"]
    assert said(api.requests[-1]) == ["one", "two", "three"]
    texts = [json.dumps(i) for i in listed.json()["data"]]
    for word in ("one", "two", "three", "reply 1"):
        assert any(word in t for t in texts), word
    assert not any("not now" in t or "appended" in t for t in texts)
