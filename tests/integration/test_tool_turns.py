"""Tools inside a turn, end to end: the loop, what commits, replay, streaming events, and
the Responses adapter reading function calls."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
from httpx_sse import aconnect_sse
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.items import function_calls, user_input_item
from service.providers.base import ProviderRequest, Reply
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, assert_error, snapshot


class Shout:
    """A test tool: upper-cases its text; "missing" is not found."""

    name = "shout"
    description = "Upper-case a text."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def run(self, arguments: dict[str, Any]) -> str | None:
        return None if arguments["text"] == "missing" else arguments["text"].upper()


shout = Shout()
TOOLS = f"{__name__}:shout"


def kinds(request: dict[str, Any]) -> list[str]:
    return [item.get("type", "message") for item in request["input"]]


async def test_a_tool_turn_commits_every_item_in_order_and_replays_it(
    make_client: ClientFactory,
) -> None:
    api = FakeResponsesAPI().then(Script(calls=[("shout", '{"text": "hi"}'), ("nope", "{}")]))
    async with make_client(provider=api.provider(), tools=TOOLS) as client:
        first = await client.post(CHAT, json={"message": "use tools"})
        assert first.status_code == 200, first.text
        assert first.json()["message"] == "reply 2"
        cid = first.json()["conversation_id"]
        view = (await client.get(f"/api/v1/conversations/{cid}")).json()
        second = await client.post(CHAT, json={"message": "again", "conversation_id": cid})
        assert second.status_code == 200
    # Round 1 advertised the tool; round 2 carried round 1's items and both outputs.
    assert api.requests[0]["tools"][0]["name"] == "shout"
    round_two = api.requests[1]["input"]
    assert kinds(api.requests[1]) == [
        "message", "reasoning", "function_call", "function_call",
        "function_call_output", "function_call_output",
    ]  # fmt: skip
    outputs = [json.loads(item["output"]) for item in round_two[-2:]]
    assert outputs == [{"status": "OK", "result": "HI"}, {"status": "UNKNOWN_TOOL", "result": None}]
    assert round_two[-2]["call_id"] == round_two[2]["call_id"]
    # The transcript shows the user message and the final answer only.
    assert [m["content"] for m in view["messages"]] == ["use tools", "reply 2"]
    calls = view["turns"][0]["tool_calls"]
    assert [(c["name"], c["accepted"], c["status"]) for c in calls] == [
        ("shout", True, "OK"), ("nope", False, "UNKNOWN_TOOL"),
    ]  # fmt: skip
    assert calls[0]["arguments"] == '{"text": "hi"}' and calls[0]["duration_ms"] >= 0
    # Next turn: every item of the tool turn is replayed verbatim, in order.
    replayed = api.requests[2]["input"]
    assert replayed[: len(round_two)] == round_two
    assert kinds(api.requests[2])[len(round_two) :] == ["reasoning", "message", "message"]


async def test_streaming_reports_each_tool_call(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(
        Script(
            calls=[
                ("shout", '{"text": "a"}'),
                ("shout", '{"text": "missing"}'),
                ("shout", '{"bad": 1}'),
            ]
        )
    )
    async with (
        make_client(provider=api.provider(), tools=TOOLS) as client,
        aconnect_sse(client, "POST", f"{CHAT}/stream", json={"message": "go"}) as source,
    ):
        events = [(sse.event, json.loads(sse.data)) async for sse in source.aiter_sse()]
    assert [data for name, data in events if name == "tool.call"] == [
        {"name": "shout", "status": "OK"},
        {"name": "shout", "status": "NOT_FOUND"},
        {"name": "shout", "status": "INVALID"},
    ]
    assert events[-1][0] == "message.done" and events[-1][1]["revision"] == 1
    text = "".join(data["delta"] for name, data in events if name == "message.delta")
    assert text == "reply 2"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_adapter_reads_function_calls_from_items_not_argument_deltas(
    stream: bool,
) -> None:
    api = FakeResponsesAPI().then(Script(calls=[("shout", '{"text": "hello"}')]))
    provider = api.provider()
    try:
        events = [
            e
            async for e in provider.respond(ProviderRequest([user_input_item("x")]), stream=stream)
        ]
    finally:
        await provider.close()
    reply = events[-1]
    assert isinstance(reply, Reply) and reply.text == ""
    [call] = function_calls(reply.output_items)
    assert (call.call_id, call.name, call.arguments) == ("call_1_0", "shout", '{"text": "hello"}')
    if stream:  # the wire really carried argument deltas, which the adapter ignores
        assert api.requests[0]["stream"] is True


async def test_the_fake_provider_uses_the_lookup_tool(
    make_client: ClientFactory, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "lookup.json"
    data.write_text(json.dumps({"capital-of-france": "Paris"}), encoding="utf-8")
    monkeypatch.setenv("LOOKUP_DATA_FILE", str(data))
    async with make_client(tools="service.tools.lookup:lookup") as client:
        response = await client.post(CHAT, json={"message": "lookup capital-of-france"})
        body = response.json()
        assert response.status_code == 200, body
        assert "Paris" in body["message"] and '"status": "OK"' in body["message"]
        view = (await client.get(f"/api/v1/conversations/{body['conversation_id']}")).json()
    assert view["turns"][0]["tool_calls"][0]["status"] == "OK"


async def test_a_failed_second_round_leaves_no_trace_of_the_first(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider(), tools=TOOLS) as client:
        cid = (await client.post(CHAT, json={"message": "start"})).json()["conversation_id"]
        before = await snapshot(engine)
        api.then(Script(calls=[("shout", '{"text": "x"}')]), Script(http_status=500))
        failed = await client.post(CHAT, json={"message": "tool then fail", "conversation_id": cid})
        assert_error(failed, 502, "upstream_error")
        assert await snapshot(engine) == before


async def test_too_many_rounds_is_upstream_error_and_commits_nothing(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    again = Script(calls=[("shout", '{"text": "x"}')])
    api.then(again, Script(calls=[("shout", '{"text": "y"}')]))
    async with make_client(provider=api.provider(), tools=TOOLS, tool_max_rounds=2) as client:
        before = await snapshot(engine)
        assert_error(await client.post(CHAT, json={"message": "loop"}), 502, "upstream_error")
        assert await snapshot(engine) == before
    assert len(api.requests) == 2  # TOOL_MAX_ROUNDS provider calls, no more


async def test_tool_results_that_outgrow_the_byte_budget_end_the_turn(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    big = "y" * 3000
    api = FakeResponsesAPI().then(Script(calls=[("shout", json.dumps({"text": big}))]))
    async with make_client(
        provider=api.provider(), tools=TOOLS, context_max_request_bytes=4000
    ) as client:
        before = await snapshot(engine)
        response = await client.post(CHAT, json={"message": "shout this"})
        assert_error(response, 400, "context_length_exceeded")
        assert await snapshot(engine) == before
    assert len(api.requests) == 1  # the second round was never sent
    assert len(api.bodies[0]) <= 4000
