from __future__ import annotations

import httpx


async def test_two_turns_and_read_back(client: httpx.AsyncClient) -> None:
    first = await client.post("/api/v1/chat", json={"message": "ping"})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["message"] == "[fake-llm] ping"
    assert body["revision"] == 1
    assert first.headers["etag"] == '"1"'
    cid = body["conversation_id"]

    second = await client.post("/api/v1/chat", json={"message": "again", "conversation_id": cid})
    assert second.json()["message"] == "[fake-llm] again (history=2)"

    read = await client.get(f"/api/v1/conversations/{cid}")
    assert read.status_code == 200
    assert [m["content"] for m in read.json()["messages"]] == [
        "ping", "[fake-llm] ping", "again", "[fake-llm] again (history=2)",
    ]  # fmt: skip
