"""Compaction ("Compaction" in the contract): the older context turned into one opaque
compaction item, committed with the turn that made it; later windows start there.

The fake Responses API at the HTTP level (its compaction: the input's user messages, then
``cmp_<n>``) shows what the provider received; the built-in fake proves it in its reply
(``compacted=M``) and refuses an opaque item it did not seal for the model. Real replicas for
the race."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from tests.support.fakeapi import FakeResponsesAPI, openai_id
from tests.support.helpers import CHAT, Target, assert_error, sdk

COMPACT_AT_ONCE = [{"type": "compaction", "compact_threshold": 1}]


def kinds(request: dict[str, Any]) -> list[str]:
    return [item.get("type", "message") for item in request["input"]]


def said(request: dict[str, Any]) -> list[str]:
    """The texts of the user messages a request carried."""
    out = []
    for item in request["input"]:
        if item.get("role") == "user":
            content = item["content"]
            out.append(content if isinstance(content, str) else content[0]["text"])
    return out


def compacts(api: FakeResponsesAPI) -> list[int]:
    """Which of the provider calls so far were compactions."""
    return [n for n, url in enumerate(api.urls) if url.endswith("/responses/compact")]


async def test_a_turn_over_its_threshold_compacts_first_and_later_turns_start_there(
    target: Target,
) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        first = await client.responses.create(
            conversation=conversation.id, input="one", context_management=COMPACT_AT_ONCE
        )
        assert compacts(api) == [] and [o.type for o in first.output] == ["reasoning", "message"]
        second = await client.responses.create(
            conversation=conversation.id, input="two", context_management=COMPACT_AT_ONCE
        )
        # The compaction got the window, the turn the compacted context and its new input.
        assert compacts(api) == [1]
        assert api.requests[1]["input"] == api.requests[0]["input"] + first_output(api, 0)
        assert kinds(api.requests[2]) == ["message", "compaction", "message"]
        assert said(api.requests[2]) == ["one", "two"]
        assert [o.type for o in second.output] == ["compaction", "reasoning", "message"]
        assert second.usage is not None and second.usage.total_tokens == 2 * 15  # both calls
        assert (await client.responses.retrieve(second.id)).output == second.output
        await client.responses.create(conversation=conversation.id, input="three")
        # The next turn starts at the compacted context: the first turn is out for good.
        assert kinds(api.requests[3])[:2] == ["message", "compaction"]
        assert said(api.requests[3]) == ["one", "two", "three"]
        assert compacts(api) == [1]  # no threshold asked: no compaction
        transcript = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        # The compaction item, sent back as the Response showed it, is restored to its bytes.
        shown = second.output[0].model_dump(exclude_none=True)
        assert shown["id"] != openai_id("cmp", 2)  # shown by an id of turnstore's
        await client.responses.create(
            input=[shown, {"role": "user", "content": "four"}], model="gpt-test", store=False
        )
        assert api.requests[-1]["input"][0] == {
            "type": "compaction", "id": openai_id("cmp", 2), "encrypted_content": "gAAA-compacted-2=="
        }  # fmt: skip
    assert [m["content"] for m in transcript["messages"]] == [
        "one", "reply 1", "two", "reply 3", "three", "reply 4"
    ]  # fmt: skip
    assert [m["in_context"] for m in transcript["messages"]] == [False] * 2 + [True] * 4
    assert transcript["context_start"] == 2


def first_output(api: FakeResponsesAPI, call: int) -> list[Any]:
    """What the provider answered call ``call`` (the fake numbers its items from 1)."""
    number = call + 1
    return [
        {"id": openai_id("rs", number), "type": "reasoning", "summary": [],
         "encrypted_content": f"gAAA-sealed-{number}=="},
        {"id": openai_id("msg", number), "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": f"reply {number}", "annotations": [],
                      "logprobs": []}]},
    ]  # fmt: skip


async def test_a_window_whose_user_messages_pass_the_reply_limit_still_compacts(
    make_client: Any,
) -> None:
    """A compaction answers the user messages it keeps: with ~380 KB of them, more than a
    reply may hold (UPSTREAM_MAX_BODY_BYTES, 256 KiB), it still compacts and the turn runs on
    it (it was 502 on every later turn, the conversation stuck for good)."""
    api = FakeResponsesAPI()
    settings = {"context_strategy": "compact", "compact_threshold_tokens": 1_000}
    async with make_client(provider=api.provider(), **settings) as client:
        cid = None
        for n in range(5):
            body: dict[str, Any] = {"message": f"{n} " + "words " * 16_000}
            answer = await client.post(CHAT, json=body | {"conversation_id": cid})
            assert answer.status_code == 200, answer.text
            cid = answer.json()["conversation_id"]
    assert compacts(api), api.urls
    compacted = api.requests[compacts(api)[-1]]  # answered with its user messages
    assert sum(len(text) for text in said(compacted)) > 256 * 1024
    assert kinds(api.requests[-1])[-2:] == ["compaction", "message"]  # the turn ran on it


async def test_a_model_switch_leaves_the_compaction_item_out(target: Target) -> None:
    """Opaque items go back only to the model that made them: the built-in fake refuses a
    compaction item sealed for another model, so a reply at all proves it was left out."""
    async with sdk(target, models="*") as (client, _, _plain):
        conversation = await client.conversations.create()
        for word in ("one", "two"):
            answer = await client.responses.create(
                conversation=conversation.id, input=word, context_management=COMPACT_AT_ONCE
            )
        assert "compacted=" in answer.output_text
        other = await client.responses.create(
            conversation=conversation.id, input="three", model="fake-other"
        )
        back = await client.responses.create(conversation=conversation.id, input="four")
    assert "compacted=" not in other.output_text and other.status == "completed"
    assert "compacted=" in back.output_text  # its own model gets it back


async def test_compacting_on_demand_is_a_commit_under_if_match(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (_client, _, plain):
        made = await plain.post(CHAT, json={"message": "one"})
        cid = made.json()["conversation_id"]
        url = f"/api/v1/conversations/{cid}/compact"
        stale = await plain.post(url, json={}, headers={"If-Match": '"7"'})
        assert_error(stale, 412, "precondition_failed")
        assert_error(await plain.post(url, json={"model": "x"}), 400, "invalid_input")
        done = await plain.post(url, json={}, headers={"If-Match": '"1"'})
        assert done.status_code == 200, done.text
        assert done.json()["revision"] == 2 and done.headers["ETag"] == '"2"'
        assert done.json()["usage"]["total_tokens"] == 15
        assert kinds(api.requests[-1]) == ["message", "reasoning", "message"]
        await plain.post(CHAT, json={"message": "two", "conversation_id": cid})
        assert kinds(api.requests[-1]) == ["message", "compaction", "message"]
        read = (await plain.get(f"/api/v1/conversations/{cid}")).json()
        unknown = await plain.post(f"/api/v1/conversations/{uuid.uuid4()}/compact", json={})
    assert [m["content"] for m in read["messages"]] == ["one", "reply 1", "two", "reply 3"]
    assert read["revision"] == 3
    assert_error(unknown, 404, "conversation_not_found")


async def test_the_agents_compaction_session_runs_end_to_end(target: Target) -> None:
    """OpenAIResponsesCompactionSession over a local session: after the first turn it compacts
    through turnstore's /v1/responses/compact (previous_response_id: the response is stored),
    and the next turn sends the compaction item."""
    # Imported here: the Agents SDK takes a second to import, which every pytest worker paid
    # to collect this module.
    from agents import Agent, Runner, SQLiteSession
    from agents.memory import OpenAIResponsesCompactionSession
    from agents.models.openai_provider import OpenAIProvider
    from agents.run import RunConfig

    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        # Its compact call reads OpenAI's type, which refuses the user messages a compaction
        # keeps under strict validation (as against OpenAI): a lax client for it.
        asked: list[dict[str, Any]] = []

        async def record(request: httpx.Request) -> None:
            asked.append(json.loads(request.content))

        http = httpx.AsyncClient(event_hooks={"request": [record]})
        lax = openai.AsyncOpenAI(
            base_url=str(client.base_url), api_key="x", max_retries=0, http_client=http
        )
        session = OpenAIResponsesCompactionSession(
            "s1", SQLiteSession("s1"), client=lax, model="gpt-test",
            should_trigger_compaction=lambda _context: True,
        )  # fmt: skip
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))
        agent = Agent(name="a", instructions="Be terse.", model="gpt-test")
        first = await Runner.run(agent, "one", session=session, run_config=config)
        second = await Runner.run(agent, "two", session=session, run_config=config)
        await lax.close()
    # Each run compacted after its turn, naming its stored response; turnstore sent the
    # provider that response's history.
    assert compacts(api) == [1, 3]
    assert [set(a) for a in asked] == [{"model", "previous_response_id"}] * 2
    assert said(api.requests[1]) == ["one"]
    # The second turn sent what the first compaction made: the kept message, the item.
    assert kinds(api.requests[2]) == ["message", "compaction", "message"]
    assert said(api.requests[2]) == ["one", "two"]
    assert (first.final_output, second.final_output) == ("reply 1", "reply 3")


# --- replicas ------------------------------------------------------------------------------


async def test_a_malformed_context_management_is_refused_naming_it(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        for wrong in ([{"type": "summary"}], [{"type": "compaction", "compact_threshold": 0}]):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(input="x", context_management=wrong)  # type: ignore[arg-type]
            assert refused.value.param == "context_management"


async def test_responses_compact_refuses_a_malformed_item_before_the_provider(
    target: Target,
) -> None:
    """Its input items are checked as a create's: a message whose role is not a string is the
    client's 400 naming ``input``, and nothing reaches the provider (the fuzzer found a 500)."""
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (_, _, plain):
        bad = await plain.post(
            "/v1/responses/compact",
            json={"model": "gpt-test", "input": [{"role": ["user"], "content": "hi"}]},
        )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "input"
    assert compacts(api) == []
