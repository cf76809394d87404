"""One owner's conversations spread over every Citus worker, and a worker down stops only the
conversations placed on it (CONTRACT.md, `turnstore db distribute`; issue 44): the owner's
own rows (its running turns' places, its Idempotency-Keys) are the coordinator's, so none of
its turns needs the stopped worker unless its conversation is there. With `AUTH_MODE=none`
every client is that one owner. Each worker is stopped in turn (a cluster of this test's own,
tests/support/citus.py): under the placement by owner (before issue 44) one of the two stops
every turn of the owner, plain or with an Idempotency-Key. Streamed turns on both surfaces
too: each ends (a stream on a healthy worker once stayed open with no terminal event, kept
alive by comments, until the stopped worker came back: issue 44), within a bound far below
that."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from contextlib import ExitStack
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from service.platform import migrate
from service.store.postgres.placement import distribute
from tests.support.citus import citus_cluster, citus_database, require_citus, restarted, stop
from tests.support.helpers import CHAT
from tests.system.test_citus_worker_down import _client, _conversations_on_both_workers

KEYS = itertools.count()


def test_a_worker_down_stops_only_the_owners_conversations_placed_on_it() -> None:
    require_citus()
    with citus_cluster() as cluster, ExitStack() as later, citus_database(cluster) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=8))
        on = asyncio.run(_conversations_on_both_workers(url))  # one owner: every client's
        assert set(on.values()) == {worker.port for worker in cluster.workers}, on
        for down in cluster.workers:
            stop(down)
            answers = asyncio.run(_turns(url, on))
            later.enter_context(restarted(down))
            for cid, port in on.items():
                got = answers[cid]
                if port == down.port:
                    assert set(got.values()) == {(500, "storage_error")}, (down.port, got)
                else:
                    assert set(got.values()) == {(200, None)}, (down.port, got)
                streamed = answers[f"{cid} streamed"]
                if port == down.port:  # refused before its stream, or ended by its error
                    assert set(streamed.values()) <= {(500, "storage_error")}, streamed
                else:
                    assert set(streamed.values()) == {(200, None)}, (down.port, streamed)


STREAM_BOUND_S = 60  # a stream that has not ended by then hangs (a turn here takes well under 1 s)


async def _turns(url: str, on: dict[str, int]) -> dict[str, dict[str, tuple[int, Any]]]:
    """Each conversation's turns with one worker down: plain, with an Idempotency-Key, and that
    request again (a retry: answered from the key's record, the provider not called)."""
    answers: dict[str, dict[str, tuple[int, Any]]] = {}
    async with _client(url) as client:
        for cid in on:
            body = {"message": "again", "conversation_id": cid}
            key = {"Idempotency-Key": f"spread-{next(KEYS)}"}
            got = answers[cid] = {}
            revisions = []
            for name, headers in (("plain", {}), ("keyed", key), ("retried", key)):
                turn = await client.post(CHAT, json=body, headers=headers)
                error = turn.json().get("error") if turn.status_code != 200 else None
                got[name] = (turn.status_code, error and error["code"])
                revisions.append(turn.json().get("revision"))
            if got["keyed"][0] == 200:  # the retry is the keyed turn's answer: no new turn
                assert revisions[2] == revisions[1] == revisions[0] + 1, revisions
            streamed = answers[f"{cid} streamed"] = {}
            v1 = {"conversation": f"conv_{uuid.UUID(cid).hex}", "input": "again", "stream": True}
            for n in range(2):
                streamed[f"chat {n}"] = await _streamed(client, "/api/v1/chat/stream", body)
                streamed[f"v1 {n}"] = await _streamed(client, "/v1/responses", v1)
    return answers


async def _streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A streamed turn's end: (200, None) when it completed, else its status and error code
    (an error event's, for a stream that started)."""
    async with (
        asyncio.timeout(STREAM_BOUND_S),
        aconnect_sse(client, "POST", path, json=body) as source,
    ):
        if source.response.status_code != 200:
            await source.response.aread()
            return source.response.status_code, source.response.json()["error"]["code"]
        async for event in source.aiter_sse():
            if event.event in ("message.done", "response.completed"):
                return 200, None
            if event.event in ("error", "response.failed"):
                data = event.json()
                error = data.get("error") or data.get("response", {}).get("error") or {}
                return 500, error.get("code")
    return 200, "ended without a terminal event"
