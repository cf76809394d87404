"""Forks: POST /api/v1/conversations/{id}/fork {"at_revision": r} makes a new conversation
holding turns 1..r as they are; each conversation then goes on, and is deleted, on its own."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import ClientFactory
from tests.support.helpers import CHAT, JWT_SETTINGS, assert_error, jwt_bearer


async def say(
    client: httpx.AsyncClient, cid: str | None, message: str, **kw: Any
) -> dict[str, Any]:
    body = {"message": message, "conversation_id": cid}
    response = await client.post(CHAT, json=body, **kw)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_a_fork_goes_on_with_its_own_history(make_client: ClientFactory) -> None:
    async with make_client() as client:
        cid = (await say(client, None, "one"))["conversation_id"]
        for message in ("two", "three"):
            await say(client, cid, message)
        response = await client.post(f"/api/v1/conversations/{cid}/fork", json={"at_revision": 2})
        assert response.status_code == 201, response.text
        fork = response.json()
        assert fork["revision"] == 2 and response.headers["etag"] == '"2"'
        assert fork["forked_from"] == {"conversation_id": cid, "revision": 2}
        # The fake provider checks the sealed reasoning it gets back: replayed verbatim.
        on_fork = await say(client, fork["conversation_id"], "fork three")
        assert on_fork["message"] == "[fake-llm] fork three (history=4)"
        on_source = await say(client, cid, "four")
        assert on_source["message"] == "[fake-llm] four (history=6)"
        forked = (await client.get(f"/api/v1/conversations/{fork['conversation_id']}")).json()
        assert [m["content"] for m in forked["messages"][::2]] == ["one", "two", "fork three"]
        assert (await client.delete(f"/api/v1/conversations/{cid}")).status_code == 204
        assert (
            await client.get(f"/api/v1/conversations/{fork['conversation_id']}")
        ).status_code == 200


async def test_a_fork_point_must_be_a_revision(make_client: ClientFactory) -> None:
    async with make_client() as client:
        cid = (await say(client, None, "one"))["conversation_id"]
        for at in (0, 2):
            refused = await client.post(
                f"/api/v1/conversations/{cid}/fork", json={"at_revision": at}
            )
            assert_error(refused, 400, "invalid_input")
        unknown = await client.post(
            "/api/v1/conversations/00000000-0000-0000-0000-000000000000/fork",
            json={"at_revision": 1},
        )
        assert_error(unknown, 404, "conversation_not_found")


async def test_another_owners_conversation_cannot_be_forked(make_client: ClientFactory) -> None:
    async with make_client(**JWT_SETTINGS) as client:
        cid = (await say(client, None, "mine", headers=jwt_bearer("alice")))["conversation_id"]
        stolen = await client.post(
            f"/api/v1/conversations/{cid}/fork", json={"at_revision": 1}, headers=jwt_bearer("bob")
        )
        assert_error(stolen, 404, "conversation_not_found")
