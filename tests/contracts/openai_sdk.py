"""The official ``openai`` SDK as turnstore's client (/v1), with strict response validation:
every answer must parse as the SDK's own types. The provider behind turnstore is the fake
Responses API (tests/support/fakeapi.py) or the built-in fake; the database is real."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import (
    JWT_SETTINGS,
    Target,
    jwt_bearer,
    sdk,
)


async def test_conversation_crud(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        made = await client.conversations.create(metadata={"topic": "demo"})
        assert made.id.startswith("conv_") and made.metadata == {"topic": "demo"}
        got = await client.conversations.retrieve(made.id)
        assert (got.id, got.created_at, got.metadata) == (made.id, made.created_at, made.metadata)
        updated = await client.conversations.update(made.id, metadata={"topic": "other"})
        assert updated.metadata == {"topic": "other"}
        # An empty conversation is a conversation on /api/v1 too: revision 0, no messages.
        view = (await plain.get(f"/api/v1/conversations/{made.id}")).json()
        assert (view["revision"], view["messages"]) == (0, [])
        deleted = await client.conversations.delete(made.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (
            made.id,
            True,
            "conversation.deleted",
        )
        with pytest.raises(openai.NotFoundError) as missing:
            await client.conversations.retrieve(made.id)
        assert missing.value.code == "conversation_not_found"


async def test_metadata_rules_and_if_match(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        with pytest.raises(openai.BadRequestError) as many:
            await client.conversations.create(metadata={f"k{i}": "v" for i in range(17)})
        assert (many.value.param, many.value.code) == ("metadata", "invalid_input")
        with pytest.raises(openai.BadRequestError) as long_value:
            await client.conversations.create(metadata={"k": "v" * 513})
        assert long_value.value.param == "metadata"
        made = await client.conversations.create()
        await client.responses.create(conversation=made.id, input="one")
        stale = {"If-Match": '"0"'}
        with pytest.raises(openai.APIStatusError) as refused:
            await client.conversations.update(made.id, metadata={"a": "b"}, extra_headers=stale)
        assert (refused.value.status_code, refused.value.code) == (412, "precondition_failed")
        fresh = {"If-Match": '"1"'}
        updated = await client.conversations.update(
            made.id, metadata={"a": "b"}, extra_headers=fresh
        )
        assert updated.metadata == {"a": "b"}
        view = (await plain.get(f"/api/v1/conversations/{made.id}")).json()
        assert view["revision"] == 1  # a metadata update is no commit


async def test_a_turn_answers_a_response_and_both_surfaces_show_it(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        first = await client.responses.create(conversation=conversation.id, input="ping")
        assert first.output_text == "[fake-llm] ping"
        assert first.status == "completed" and first.conversation.id == conversation.id
        second = await client.responses.create(
            conversation={"id": conversation.id}, input=[{"role": "user", "content": "pong"}]
        )
        assert second.output_text == "[fake-llm] pong (history=2)"
        again = await client.responses.retrieve(second.id)
        assert (again.id, again.output_text) == (second.id, second.output_text)
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert [m["content"] for m in view["messages"]] == [
            "ping",
            first.output_text,
            "pong",
            second.output_text,
        ]
        # ... and a conversation begun on /api/v1 continues on /v1, by either id.
        begun = (await plain.post("/api/v1/chat", json={"message": "hello"})).json()
        more = await client.responses.create(conversation=begun["conversation_id"], input="more")
        assert more.output_text == "[fake-llm] more (history=2)"


async def test_the_stream_helper_gets_the_committed_response(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        async with client.responses.stream(
            conversation=conversation.id, input="stream it", model="fake-llm"
        ) as s:
            deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
            final = await s.get_final_response()
        assert "".join(deltas) == final.output_text == "[fake-llm] stream it"
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 1 and view["messages"][1]["content"] == final.output_text
        assert (await client.responses.retrieve(final.id)).output_text == final.output_text


async def test_items_page_with_the_sdk_cursor_and_hide_sealed_reasoning(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        for text in ("one", "two"):
            await client.responses.create(conversation=conversation.id, input=text)
        everything = [
            i async for i in client.conversations.items.list(conversation.id, order="asc")
        ]
        assert [i.type for i in everything] == ["message", "reasoning", "message"] * 2
        assert len({i.id for i in everything}) == 6 and all(i.id for i in everything)
        one_by_one = [
            i async for i in client.conversations.items.list(conversation.id, limit=1, order="asc")
        ]
        assert [i.id for i in one_by_one] == [i.id for i in everything]
        newest_first = [i async for i in client.conversations.items.list(conversation.id, limit=2)]
        assert [i.id for i in newest_first] == [i.id for i in everything][::-1]
        reasoning = everything[1]
        assert getattr(reasoning, "encrypted_content", None) is None
        sealed = await client.conversations.items.retrieve(
            reasoning.id, conversation_id=conversation.id, include=["reasoning.encrypted_content"]
        )
        assert sealed.type == "reasoning" and sealed.encrypted_content
        user = await client.conversations.items.retrieve(
            everything[0].id, conversation_id=conversation.id
        )
        assert user.type == "message" and user.role == "user" and user.status == "completed"


async def test_items_given_at_creation_are_one_commit_replayed_as_sent(target: Target) -> None:
    api = FakeResponsesAPI()
    items = [
        {"type": "message", "role": "user", "content": "Remember: the code is 42."},
        {"type": "message", "role": "assistant", "content": "Noted."},
    ]
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create(items=items)  # type: ignore[arg-type]
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 1
        shown = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert [(i.role, i.content[0].text) for i in shown] == [  # type: ignore[union-attr]
            ("user", "Remember: the code is 42."),
            ("assistant", "Noted."),
        ]
        await client.responses.create(conversation=conversation.id, input="What is the code?")
        assert api.requests[0]["input"][:2] == items  # the stored bytes, re-sent as they came
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.create(items=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]
        assert refused.value.param == "items"


async def test_appending_items_is_one_commit_the_next_turn_sees(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="first")
        note = {"type": "message", "role": "user", "content": "Also: I like tea."}
        added = await client.conversations.items.create(conversation.id, items=[note])  # type: ignore[list-item]
        assert len(added.data) == 1 and added.first_id == added.last_id == added.data[0].id
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 2 and view["messages"][2]["content"] == "Also: I like tea."
        await client.responses.create(conversation=conversation.id, input="What do I like?")
        assert api.requests[-1]["input"][-2] == note  # the appended item, as sent, before it
        with pytest.raises(openai.APIStatusError) as stale:
            await client.conversations.items.create(
                conversation.id,
                items=[note],
                extra_headers={"If-Match": '"2"'},  # type: ignore[list-item]
            )
        assert stale.value.status_code == 412
        assert (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()["revision"] == 3


async def test_a_busy_conversation_is_locked_for_another_replica(target: Target) -> None:
    api = FakeResponsesAPI()
    async with (
        sdk(target, api.provider()) as (a, _, _pa),
        sdk(target, api.provider(), turn_concurrency="reject") as (b, _, _pb),
    ):
        conversation = await a.conversations.create()
        gate = asyncio.Event()
        slow = Script(gate=gate)
        api.then(slow)
        running = asyncio.create_task(a.responses.create(conversation=conversation.id, input="x"))
        await slow.started.wait()
        with pytest.raises(openai.BadRequestError) as locked:
            await b.responses.create(conversation=conversation.id, input="y")
        assert (locked.value.code, locked.value.param) == ("conversation_locked", "conversation")
        gate.set()
        await running
        assert len(api.requests) == 1


async def test_an_idempotency_key_retry_answers_the_same_response(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        conversation = await client.conversations.create()
        key = {"Idempotency-Key": "retry-me"}
        first = await client.responses.create(
            conversation=conversation.id, input="once", extra_headers=key
        )
        again = await client.responses.create(
            conversation=conversation.id, input="once", extra_headers=key
        )
        assert (again.id, again.output_text) == (first.id, first.output_text)
        assert len(api.requests) == 1
        with pytest.raises(openai.UnprocessableEntityError) as reused:
            await client.responses.create(
                conversation=conversation.id, input="other", extra_headers=key
            )
        assert reused.value.code == "idempotency_key_reused"


@pytest.mark.parametrize(
    ("script", "error", "code"),
    [
        (
            Script(status="incomplete", incomplete_reason="content_filter"),
            openai.UnprocessableEntityError,
            "content_filtered",
        ),
        (
            Script(http_status=429, headers={"retry-after": "3"}),
            openai.RateLimitError,
            "rate_limited",
        ),
        (Script(http_status=500), openai.InternalServerError, "upstream_error"),
    ],
)
async def test_provider_failures_raise_the_sdk_errors_and_commit_nothing(
    target: Target, script: Script, error: type[Exception], code: str
) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        for stream in (False, True):
            api.then(
                script if not stream else Script(**{**script.__dict__, "started": asyncio.Event()})
            )
            # A stream's error event is the SDK's base APIError; a JSON answer its own class.
            with pytest.raises(openai.APIError if stream else error) as failed:
                if stream:
                    async for _ in await client.responses.create(
                        conversation=conversation.id, input="x", stream=True
                    ):
                        pass
                else:
                    await client.responses.create(conversation=conversation.id, input="x")
            assert failed.value.code == code  # type: ignore[attr-defined]
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 0


async def test_the_request_id_is_the_correlation_id(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        with pytest.raises(openai.NotFoundError) as missing:
            await client.conversations.retrieve("conv_" + "0" * 32)
        body = missing.value.body
        assert isinstance(body, dict) and missing.value.request_id == body["correlation_id"]
        assert body["type"] == "invalid_request_error" and body["param"] is None
        made = await client.conversations.with_raw_response.create()
        assert made.headers["x-request-id"] == made.headers["x-correlation-id"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": "gpt-other"}, "model"),  # not in MODELS
        ({"include": ["file_search_call.results"]}, "include"),
        ({"store": False}, "store"),  # with a conversation: it would be kept
        ({"extra_body": {"temprature": 0.2}}, "temprature"),  # the provider refuses it
    ],
)
async def test_unsupported_fields_are_refused_with_their_param(
    target: Target, fields: dict[str, Any], param: str
) -> None:
    # MODELS named: with the built-in fake and MODELS unset, every model name is served.
    async with sdk(target, models="fake-other") as (client, _, plain):
        conversation = await client.conversations.create()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(conversation=conversation.id, input="x", **fields)
        assert refused.value.param == param
        assert (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()["revision"] == 0


async def test_the_fake_serves_any_model_and_a_refusal_names_the_served_ones(
    target: Target,
) -> None:
    """Out of the box (the built-in fake, MODELS unset) a client's default model works; where
    MODELS is set, a model outside it is refused with a message that says what to do."""
    async with sdk(target) as (client, _, _plain):
        answered = await client.responses.create(model="gpt-5.2", input="hi", store=False)
        assert answered.model == "gpt-5.2" and answered.output_text
    async with sdk(target, models="fake-large") as (client, _, _plain):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="gpt-5.2", input="hi", store=False)
        message = refused.value.message
        assert refused.value.code == "model_not_found" and refused.value.param == "model"
        assert all(
            part in message for part in ("'fake-llm'", "'fake-large'", "MODELS", "/v1/models")
        )


@pytest.mark.parametrize(
    "item",
    [
        {"type": "message", "role": {"role": 1}, "content": "x"},  # found by the fuzzer: a 500
        {"type": "message", "role": "user", "content": [{"type": ["input_text"], "text": "x"}]},
        {"type": ["message"], "role": "user", "content": "x"},
        {"type": "function_call", "call_id": {"id": 1}, "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": 3},
        {"type": "reasoning", "id": ["r"], "summary": []},
    ],
)
async def test_a_malformed_item_is_refused_with_its_param_and_nothing_kept(
    target: Target, item: dict[str, Any]
) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.items.create(conversation.id, items=[item])  # type: ignore[list-item]
        assert refused.value.param == "items"
        assert (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()["revision"] == 0


async def test_previous_response_id_continues_the_latest_and_forks_at_an_earlier_one(
    target: Target,
) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        first = await client.responses.create(conversation=conversation.id, input="a")
        second = await client.responses.create(previous_response_id=first.id, input="b")
        assert second.conversation.id == conversation.id  # the latest: continued
        fork = await client.responses.create(previous_response_id=first.id, input="edited b")
        assert fork.conversation.id != conversation.id  # an earlier one: forked there
        # The model saw the source's first turn, byte for byte, then the new message.
        assert api.requests[-1]["input"][:-1] == api.requests[1]["input"][:-1]
        forked = (await plain.get(f"/api/v1/conversations/{fork.conversation.id}")).json()
        source = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert [m["content"] for m in forked["messages"][::2]] == ["a", "edited b"]
        assert [m["content"] for m in source["messages"][::2]] == ["a", "b"]  # untouched
        again = await client.responses.create(previous_response_id=fork.id, input="c")
        assert again.conversation.id == fork.conversation.id
        calls = len(api.requests)
        stateless = await client.responses.create(input="no history", model="gpt-test", store=False)
        assert stateless.conversation is None and stateless.output_text  # relayed, not kept
        assert api.requests[-1]["input"][-1]["content"] == "no history"
        assert len(api.requests) == calls + 1
        listed = (await plain.get("/api/v1/conversations")).json()["conversations"]
        assert len(listed) == 2  # the source and its fork: the stateless call made none


async def test_a_forked_turn_that_fails_leaves_no_fork(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        first = await client.responses.create(conversation=conversation.id, input="a")
        await client.responses.create(conversation=conversation.id, input="b")
        api.then(Script(http_status=500))
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(previous_response_id=first.id, input="fork")
        listed = (await plain.get("/api/v1/conversations")).json()["conversations"]
        assert [c["conversation_id"] for c in listed] == [str(uuid.UUID(conversation.id[5:]))]


async def test_truncation_disabled_refuses_a_turn_that_would_drop_history(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider(), context_max_request_bytes=8000) as (client, _, _p):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="first")
        # Nothing left out yet: a turn with truncation disabled runs.
        await client.responses.create(
            conversation=conversation.id, input="2", truncation="disabled"
        )
        for _ in range(20):  # until the window leaves the first turn out
            await client.responses.create(conversation=conversation.id, input="x" * 1000)
            if "first" not in json.dumps(api.requests[-1]["input"]):
                break
        else:
            pytest.fail("the window never moved")
        calls = len(api.requests)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                conversation=conversation.id, input="y", truncation="disabled"
            )
        assert refused.value.code == "context_length_exceeded"
        assert len(api.requests) == calls  # refused before the provider was called
        await client.responses.create(conversation=conversation.id, input="y")  # auto: fine


async def test_owners_are_the_same_as_on_api_v1(target: Target) -> None:
    async with (
        sdk(target, headers=jwt_bearer("alice"), **JWT_SETTINGS) as (alice, _, alice_plain),
        sdk(target, headers=jwt_bearer("bob"), **JWT_SETTINGS) as (bob, _, _bp),
    ):
        conversation = await alice.conversations.create()
        await alice.responses.create(conversation=conversation.id, input="mine")
        attempts: list[Callable[[], Any]] = [
            lambda: bob.conversations.retrieve(conversation.id),
            lambda: bob.responses.create(conversation=conversation.id, input="theirs"),
            lambda: bob.conversations.items.list(conversation.id),
        ]
        for attempt in attempts:
            with pytest.raises(openai.NotFoundError):
                await attempt()
        assert (
            await alice_plain.get(f"/api/v1/conversations/{conversation.id}")
        ).status_code == 200
        anonymous = openai.AsyncOpenAI(base_url=str(alice.base_url), api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.conversations.retrieve(conversation.id)
        await anonymous.close()


async def test_a_reply_cut_at_max_output_tokens_is_committed_as_incomplete(target: Target) -> None:
    api = FakeResponsesAPI()
    cut = {"status": "incomplete", "incomplete_reason": "max_output_tokens", "text": "partial"}
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        api.then(Script(**cut))
        plain_answer = await client.responses.create(conversation=conversation.id, input="a")
        assert plain_answer.status == "incomplete" and plain_answer.output_text == "partial"
        assert plain_answer.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
        api.then(Script(**cut))
        stream = await client.responses.create(conversation=conversation.id, input="b", stream=True)
        events = [event async for event in stream]
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == "partial"  # type: ignore[union-attr]
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 2  # both kept, as the contract's table says


async def test_a_request_in_progress_tells_the_sdk_to_retry(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        conversation = await client.conversations.create()
        gate = asyncio.Event()
        slow = Script(gate=gate)
        api.then(slow)
        key = {"Idempotency-Key": "once"}
        first = asyncio.create_task(
            client.responses.create(conversation=conversation.id, input="x", extra_headers=key)
        )
        await slow.started.wait()
        with pytest.raises(openai.ConflictError) as running:
            await client.responses.create(
                conversation=conversation.id, input="x", extra_headers=key
            )
        assert running.value.code == "request_in_progress"
        assert running.value.response.headers["x-should-retry"] == "true"
        gate.set()
        assert (await first).output_text


async def test_turnstores_own_tool_calls_stay_inside_the_turn(target: Target) -> None:
    api = FakeResponsesAPI().then(Script(calls=[("shout", '{"text": "hi"}')]))
    tools = "tests.integration.test_tool_turns:shout"
    async with sdk(target, api.provider(), tools=tools) as (client, _, _plain):
        conversation = await client.conversations.create()
        answer = await client.responses.create(conversation=conversation.id, input="use tools")
        assert answer.output_text == "reply 2" and len(api.requests) == 2
        assert {item.type for item in answer.output} == {"reasoning", "message"}
        shown = [i async for i in client.conversations.items.list(conversation.id)]
        assert "function_call" not in {i.type for i in shown}
        assert "function_call_output" not in {i.type for i in shown}


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def test_a_client_side_tool_round_trip_commits_the_call_then_its_answer(
    target: Target,
) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        asked = await client.responses.create(
            conversation=conversation.id, input='call get_weather {"city": "Oslo"}',
            tools=[WEATHER],  # type: ignore[list-item]
        )  # fmt: skip
        calls = [item for item in asked.output if item.type == "function_call"]
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
        assert asked.output_text == ""  # the client runs it: the turn ends with the call
        answer = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
        wrong = {**answer, "call_id": "call_nobody_made"}
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(conversation=conversation.id, input=[wrong])  # type: ignore[list-item]
        assert refused.value.param == "input"
        async with client.responses.stream(
            conversation=conversation.id,
            input=[answer],
            tools=[WEATHER],
            model="fake-llm",  # type: ignore[list-item]
        ) as stream:
            final = await stream.get_final_response()
        assert final.output_text.endswith("[tool: sunny]")
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
        assert view["revision"] == 2
        shown = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        kinds = [i.type for i in shown]
        assert kinds == ["message", "reasoning", "function_call", "function_call_output",
                         "reasoning", "message"]  # fmt: skip
