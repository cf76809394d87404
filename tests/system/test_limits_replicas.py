"""Limits seen from `turnstore serve` replicas (processes): what a big conversation's reads and turns
hold. The rest of the limits are in tests/integration/test_limits.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from tests.integration.test_limits import MIB
from tests.support.cluster import fake_api, provider_env, served, turnstore_env
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import CHAT

# What one request may add to a replica's peak memory, whatever the conversation's size: a
# read holds one page of 4 turns, each at most MAX_BODY_BYTES (1 MiB) of request and
# UPSTREAM_MAX_BODY_BYTES (256 KiB) of reply, as rows, raw items and decoded items (about 4x:
# ~21 MiB), plus its answer (here at most 100 items of 47 KB, encoded and decoded: ~10 MiB).
PAGE_BOUND = 40 * MIB


def peak_rss(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@asynccontextmanager
async def writer_and_reader(
    database: str, tmp_path: Path, api: FakeResponsesAPI, **settings: str
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, int]]:
    """Two replicas on ``database``: a client of the one that writes, a client of the fresh
    one that reads, and the reader's pid (whose peak memory is measured)."""
    async with fake_api(api) as base_url:
        env = turnstore_env(DATABASE_URL=database, **provider_env(base_url), **settings)
        async with served(env, tmp_path, "writer", "reader") as (
            (_, w),
            (reader, r),
        ):
            yield w, r, reader.process.popen.pid


# What the conversations of ~60 MB of items below hold: their items, and each message's text
# twice more (the turn's user text and its transcript): every byte stored counts against
# MAX_CONVERSATION_BYTES.
HOLDS = str(256 * MIB)


async def sixty_megabytes(w: httpx.AsyncClient) -> tuple[str, str]:
    """A /v1 conversation of ~60 MB of appended items: its id and its first item's id."""
    conversation = (await w.post("/v1/conversations", json={})).json()["id"]
    text = "many words of a long appended history " * 1_250  # 47.5 KB
    for n in range(60):
        batch = [{"role": "user", "content": f"{n}.{i} {text}"} for i in range(20)]
        added = await w.post(f"/v1/conversations/{conversation}/items", json={"items": batch})
        assert added.status_code == 200, added.text
    return conversation, added.json()["data"][0]["id"]


# What one turn may add to a fresh replica's peak memory, whatever its conversation's size: it
# reads the turns from the committed window start on, which the previous turn chose to fit
# CONTEXT_MAX_REQUEST_BYTES (1 MiB), plus what that turn added (at most a 1 MiB body and a
# 256 KiB reply): ~2.3 MiB of items, held as rows, raw items and decoded items, and once more
# by the history cache (about 5x: ~12 MiB), then sent as one request (1 MiB) and answered.
# Measured: 7 MiB; loading the whole history, as a turn on a cold replica did before, grew it
# by 219 MiB (~3.5x the conversation).
TURN_BOUND = 24 * MIB


def assert_error_code(response: httpx.Response, code: str) -> None:
    assert response.json()["error"]["code"] == code, response.text


async def test_reading_a_big_conversation_holds_a_page_not_the_conversation(
    database: str, tmp_path: Path
) -> None:
    """One replica writes a ~60 MB conversation; another, fresh, serves every read of its
    items: its peak memory grows by less than a page's bound (loading the whole conversation,
    as every one of these reads did, grew a replica by ~500 MB for three times this size)."""
    async with writer_and_reader(
        database, tmp_path, FakeResponsesAPI(), MAX_CONVERSATION_BYTES=HOLDS
    ) as (w, r, pid):
        conversation, first_id = await sixty_megabytes(w)
        items = f"/v1/conversations/{conversation}/items"
        answer = await w.post("/v1/responses", json={"conversation": conversation,
                                                     "input": "and now?"})  # fmt: skip
        assert answer.status_code == 200, answer.text
        response = answer.json()["id"]
        before = peak_rss(pid)
        reads = [
            ("GET", items, {"limit": 1}),
            ("GET", items, {"limit": 100, "order": "asc"}),
            ("GET", items, {"limit": 2, "after": first_id}),
            ("GET", f"{items}/msg_not_there", {}),
            ("DELETE", f"{items}/{first_id}", {}),
            ("GET", f"/v1/responses/{response}", {}),
            ("GET", f"/v1/responses/{response}/input_items", {}),
        ]
        statuses = [
            (await r.request(method, url, params=params)).status_code
            for method, url, params in reads
        ]
        grown = peak_rss(pid) - before
    assert statuses == [200, 200, 200, 404, 400, 200, 200]
    assert grown < PAGE_BOUND, f"the reader's peak memory grew by {grown / MIB:.0f} MiB"


async def test_a_turn_of_a_big_conversation_loads_its_window_not_the_history(
    database: str, tmp_path: Path
) -> None:
    """A ~60 MB conversation whose window start has moved on (CONTEXT_MAX_TURNS): one turn of
    it on a fresh replica (warmed up by a turn of a small conversation first) grows that
    replica's peak memory by less than TURN_BOUND, and its provider request is its window."""
    api = FakeResponsesAPI()
    async with writer_and_reader(
        database, tmp_path, api, CONTEXT_MAX_TURNS="2", MAX_CONVERSATION_BYTES=HOLDS
    ) as (w, r, pid):
        conv, _ = await sixty_megabytes(w)
        cid = conv.removeprefix("conv_")
        moved = await w.post(CHAT, json={"conversation_id": cid, "message": "sum up"})
        assert moved.status_code == 200, moved.text  # its window: the latest turns
        warm = await r.post(CHAT, json={"message": "warm up"})
        assert warm.status_code == 200, warm.text
        before = peak_rss(pid)
        turn = await r.post(CHAT, json={"conversation_id": cid, "message": "and now?"})
        grown = peak_rss(pid) - before
    assert turn.status_code == 200, turn.text
    assert grown < TURN_BOUND, f"the replica's peak memory grew by {grown / MIB:.0f} MiB"
    sent = api.requests[-1]["input"]
    assert len(sent) < 2 * 20 + 3  # at most the two latest turns and the new message
    assert sent[-1]["content"] == [{"type": "input_text", "text": "and now?"}]


async def test_a_turn_after_many_appended_items_reads_what_it_can_send_not_all_of_them(
    database: str, tmp_path: Path
) -> None:
    """~60 MB of items appended after the conversation's last turn (its window start has not
    moved since): the next turn, on a fresh replica, reads its items only as far back as a
    request can carry them (CONTEXT_MAX_REQUEST_BYTES), so its peak memory grows by less than
    TURN_BOUND (it read every appended item before: +156 MiB for 40 MB)."""
    api = FakeResponsesAPI()
    async with writer_and_reader(database, tmp_path, api, MAX_CONVERSATION_BYTES=HOLDS) as (
        w,
        r,
        pid,
    ):
        conv, _ = await sixty_megabytes(w)
        warm = await r.post(CHAT, json={"message": "warm up"})
        assert warm.status_code == 200, warm.text
        before = peak_rss(pid)
        turn = await r.post(CHAT, json={"conversation_id": conv, "message": "and now?"})
        grown = peak_rss(pid) - before
        assert turn.status_code == 200, turn.text
        window = await r.get(f"/api/v1/conversations/{conv}", params={"before": 2**31 - 1})
    assert grown < TURN_BOUND, f"the replica's peak memory grew by {grown / MIB:.0f} MiB"
    sent = api.requests[-1]["input"]
    assert 1 < len(sent) <= 2 * 20 + 1  # the latest appended items that fit, and the message
    assert sum(len(json.dumps(item)) for item in sent) < 1024 * 1024
    assert window.json()["context_start"] > 1  # the window start moved with the turn


async def test_what_a_v1_response_echoes_is_counted_and_not_read_by_later_turns(
    database: str, tmp_path: Path
) -> None:
    """Each /v1 turn stores what its Response echoes (here 440 KB of tool descriptions): it
    counts against MAX_CONVERSATION_BYTES, and a later turn on a fresh replica reads none of
    it (one turn of such a conversation took a replica from 115 to 652 MB with 20 of them)."""
    tool = {"type": "function", "name": "lookup", "description": "d" * 440_000,
            "parameters": {"type": "object", "properties": {}}}  # fmt: skip
    api = FakeResponsesAPI()
    async with writer_and_reader(database, tmp_path, api, MAX_CONVERSATION_BYTES=str(8 * MIB)) as (
        w,
        r,
        pid,
    ):
        conv = (await w.post("/v1/conversations", json={})).json()["id"]
        answers = []
        for n in range(20):
            ask = {"conversation": conv, "input": f"turn {n}", "tools": [tool]}
            answers.append(await w.post("/v1/responses", json=ask))
        statuses = [answer.status_code for answer in answers]
        full = statuses.index(422)  # the echo filled it: 8 MiB of 440 KB each
        assert 15 <= full <= 19 and set(statuses[:full]) == {200}, statuses
        assert_error_code(answers[full], "conversation_full")
        warm = await r.post(CHAT, json={"message": "warm up"})
        assert warm.status_code == 200, warm.text
        before = peak_rss(pid)
        turn = await r.post("/v1/responses", json={"conversation": conv, "input": "more?"})
        grown = peak_rss(pid) - before
    assert turn.status_code == 200, turn.text
    assert grown < TURN_BOUND, f"the replica's peak memory grew by {grown / MIB:.0f} MiB"
