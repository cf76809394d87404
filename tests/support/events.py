"""Reading a durable turn's events over SSE: each event as a value, following a turn, its end."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from tests.support.helpers import CHAT

STREAM = f"{CHAT}/stream"


TURNS = "/api/v1/turns"


WORDS = [f"w{n} " for n in range(12)]


@dataclass(frozen=True)
class Event:
    id: int
    name: str
    data: dict[str, Any]


async def event_names(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> list[str]:
    """A stream's events' names, to its end (it must answer 200)."""
    async with aconnect_sse(client, method, url, **kwargs) as source:
        assert source.response.status_code == 200, await source.response.aread()
        return [sse.event async for sse in source.aiter_sse()]


def event_of(sse: Any) -> Event | None:
    return (
        None
        if not sse.event or not sse.data
        else Event(int(sse.id), sse.event, json.loads(sse.data))
    )


async def follow(
    client: httpx.AsyncClient,
    turn_id: str,
    *,
    last_event_id: int | None = None,
    after: int | None = None,
) -> list[Event]:
    """A reader of the turn's events, to the end of its stream."""
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    params = {} if after is None else {"after": after}
    url = f"{TURNS}/{turn_id}/events"
    async with aconnect_sse(client, "GET", url, headers=headers, params=params) as source:
        assert source.response.status_code == 200, await source.response.aread()
        return [e async for sse in source.aiter_sse() if (e := event_of(sse)) is not None]


def text_of(events: list[Event]) -> str:
    return "".join(e.data["delta"] for e in events if e.name == "message.delta")


def assert_one_terminal(events: list[Event]) -> Event:
    names = [e.name for e in events]
    assert names.count("message.done") + names.count("error") == 1, names
    assert names[-1] in ("message.done", "error"), names
    return events[-1]


async def background(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post(CHAT, json={"background": True, **body})
    assert response.status_code == 202, response.text
    return dict(response.json())


async def revision(client: httpx.AsyncClient, cid: str) -> int:
    return int((await client.get(f"/api/v1/conversations/{cid}")).json()["revision"])


async def status_becomes(
    client: httpx.AsyncClient, turn_id: str, status: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        view = (await client.get(f"{TURNS}/{turn_id}", headers=headers)).json()
        if view["status"] == status:
            return dict(view)
        assert time.monotonic() < deadline, view
        await asyncio.sleep(0.02)
