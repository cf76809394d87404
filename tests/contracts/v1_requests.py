"""/v1 takes requests as real clients send them (issue "20."): the official SDK with strict
validation against a served turnstore; the provider behind it is the fake Responses API
(tests/support/fakeapi.py, which records every request the real adapter sends) or the built-in fake.

What a request carries reaches the provider (forwarded) and comes back in the Response
(echoed); instructions, models, usage, input items, If-Match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest

from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import Target, sdk

# Every field of the contract's list that turnstore does not interpret, with a value a
# client could send: each must reach the provider as it came and come back in the Response.
FORWARDED: dict[str, Any] = {
    "temperature": 0.25,
    "top_p": 0.5,
    "max_output_tokens": 300,
    "max_tool_calls": 3,
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "reasoning": {"effort": "low", "summary": "auto"},
    "metadata": {"run": "r1"},
    "user": "u-1",
    "safety_identifier": "s-1",
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "24h",
    "service_tier": "flex",
    "top_logprobs": 2,
}
ECHOED = (
    "temperature", "top_p", "max_output_tokens", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key",
)  # fmt: skip


async def test_every_other_field_reaches_the_provider_and_is_echoed(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        conversation = await client.conversations.create()
        answer = await client.responses.create(
            conversation=conversation.id, input="hi", **FORWARDED
        )
    sent = api.requests[-1]
    assert {name: sent.get(name) for name in FORWARDED} == FORWARDED
    assert sent["store"] is False and "reasoning.encrypted_content" in sent["include"]
    shown = answer.model_dump(exclude_none=True)
    assert {name: shown[name] for name in ECHOED} == {name: FORWARDED[name] for name in ECHOED}
    # The provider's usage, as it reported it (tests/support/fakeapi.py: 10 in, 5 out).
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens, answer.usage.total_tokens) == (
        10, 5, 15
    )  # fmt: skip


async def test_a_stateless_call_forwards_and_echoes_too(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        answer = await client.responses.create(
            model="gpt-test", input="hi", temperature=0.3, tool_choice="none", store=False
        )
    assert (api.requests[-1]["temperature"], api.requests[-1]["tool_choice"]) == (0.3, "none")
    assert (answer.temperature, answer.tool_choice, answer.store) == (0.3, "none", False)


async def test_a_field_the_provider_refuses_is_its_400_with_its_param(target: Target) -> None:
    api = FakeResponsesAPI().then(
        Script(http_status=400, error_code="unknown_parameter", error_param="temprature")
    )
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                conversation=conversation.id, input="hi", extra_body={"temprature": 1}
            )
        assert (refused.value.code, refused.value.param) == ("unknown_parameter", "temprature")
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
    assert view["revision"] == 0  # nothing was kept
    assert api.requests[-1]["temprature"] == 1  # it was sent as it came


async def test_the_built_in_fake_refuses_as_the_responses_api_does(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                conversation=conversation.id, input="hi", extra_body={"colour": "blue"}
            )
        assert (refused.value.code, refused.value.param) == ("unknown_parameter", "colour")
        # In a stream the refusal is its error event: the SDK raises it too.
        with pytest.raises(openai.APIError):
            async with client.responses.stream(
                conversation=conversation.id, input="hi", model="fake-llm",
                extra_body={"colour": "blue"},
            ) as events:  # fmt: skip
                async for _ in events:
                    pass
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
    assert view["revision"] == 0


async def test_max_output_tokens_stops_the_reply_and_commits_it_incomplete(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        answer = await client.responses.create(
            conversation=conversation.id, input="a long enough message", max_output_tokens=2
        )
        assert answer.status == "incomplete"
        assert answer.incomplete_details is not None
        assert answer.incomplete_details.reason == "max_output_tokens"
        assert answer.output_text == "[fake-llm] a long enough message"[:8]
        assert answer.max_output_tokens == 2


class City(pydantic.BaseModel):
    name: str
    population: int
    districts: list[str]


async def test_structured_outputs_with_responses_parse(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        parsed = await client.responses.parse(
            conversation=conversation.id, input="Paris", text_format=City, model="fake-llm"
        )
    assert isinstance(parsed.output_parsed, City)
    assert parsed.output_parsed.name.startswith("[fake-llm] Paris")
    assert parsed.text is not None and parsed.text.format.type == "json_schema"


async def test_tool_choice_naming_a_function_calls_it(target: Target) -> None:
    weather = {
        "type": "function", "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
    }  # fmt: skip
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        asked = await client.responses.create(
            conversation=conversation.id, input="Oslo", tools=[weather],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
        )  # fmt: skip
    calls = [item for item in asked.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    assert asked.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    assert [tool.name for tool in asked.tools] == ["get_weather"]  # type: ignore[union-attr]


async def test_instructions_follow_the_server_prompt_for_one_response_only(
    target: Target, tmp_path: Path
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("You are turnstore's assistant.")
    api = FakeResponsesAPI()
    async with sdk(target, api.provider(), system_prompt_file=prompt) as (c, _, plain):
        conversation = await c.conversations.create()
        first = await c.responses.create(
            conversation=conversation.id, input="one", instructions="Answer in French."
        )
        await c.responses.create(previous_response_id=first.id, input="two")
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
    assert first.instructions == "Answer in French."
    assert api.requests[0]["instructions"] == "You are turnstore's assistant.\n\nAnswer in French."
    assert api.requests[1]["instructions"] == "You are turnstore's assistant."  # not carried
    versions = [turn["prompt_version"] for turn in view["turns"]]
    assert versions[0] != versions[1] and all(v.startswith("sha256:") for v in versions)
    assert "French" not in str(view)  # the digest is kept, never the text


@pytest.mark.parametrize("mode", ["client", "server"])
async def test_instructions_replace_or_are_refused_as_configured(
    target: Target, tmp_path: Path, mode: str
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Server prompt.")
    api = FakeResponsesAPI()
    settings = {"system_prompt_file": prompt, "instructions": mode}
    async with sdk(target, api.provider(), **settings) as (client, _, _plain):
        conversation = await client.conversations.create()
        if mode == "server":
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(
                    conversation=conversation.id, input="x", instructions="mine"
                )
            assert refused.value.param == "instructions"
            assert api.requests == []
        else:
            await client.responses.create(
                conversation=conversation.id, input="x", instructions="mine"
            )
            assert api.requests[0]["instructions"] == "mine"


async def test_models_are_listed_and_only_they_are_served(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider(), models="gpt-small, gpt-large") as (c, _, _p):
        listed = [model.id async for model in c.models.list()]
        assert listed == ["gpt-test", "gpt-large", "gpt-small"]
        assert (await c.models.retrieve("gpt-large")).id == "gpt-large"
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("gpt-other")
        conversation = await c.conversations.create()
        with pytest.raises(openai.BadRequestError) as refused:
            await c.responses.create(conversation=conversation.id, input="x", model="gpt-other")
        assert (refused.value.code, refused.value.param) == ("model_not_found", "model")
        answer = await c.responses.create(
            conversation=conversation.id, input="x", model="gpt-large"
        )
    assert answer.model == "gpt-large" and api.requests[-1]["model"] == "gpt-large"


async def test_a_model_switch_never_resends_sealed_items_to_another_model(target: Target) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider(), models="gpt-other") as (client, _, _plain):
        conversation = await client.conversations.create()
        for model in ("gpt-test", "gpt-other", "gpt-test"):
            await client.responses.create(conversation=conversation.id, input="x", model=model)

    def kinds(request: dict[str, Any]) -> list[str]:
        return [item.get("type", "message") for item in request["input"]]

    assert kinds(api.requests[1]) == ["message", "message", "message"]  # its messages stay
    # Back on the first model: its own sealed reasoning goes back to it, the other's does not.
    assert kinds(api.requests[2]) == ["message", "reasoning", "message"] + ["message"] * 3
    assert len(api.requests) == 3  # no call was refused and retried


async def test_a_model_switch_with_the_built_in_fake_keeps_working(target: Target) -> None:
    """The built-in fake seals reasoning for its model and refuses another model's: the
    conversation goes on across models without a failed call."""
    async with sdk(target, models="fake-other") as (client, _, _plain):
        conversation = await client.conversations.create()
        first = await client.responses.create(conversation=conversation.id, input="one")
        other = await client.responses.create(
            conversation=conversation.id, input="two", model="fake-other"
        )
        back = await client.responses.create(conversation=conversation.id, input="three")
    assert (first.model, other.model, back.model) == ("fake-llm", "fake-other", "fake-llm")
    assert other.output_text == "[fake-llm] two (history=2)"
    assert back.output_text == "[fake-llm] three (history=4)"


async def test_usage_adds_up_the_provider_calls_of_a_tool_turn(target: Target) -> None:
    api = FakeResponsesAPI().then(Script(calls=[("lookup", '{"key": "k"}')]), Script())
    settings = {"tools": "service.tools.lookup:lookup"}
    async with sdk(target, api.provider(), **settings) as (client, _, plain):
        conversation = await client.conversations.create()
        answer = await client.responses.create(conversation=conversation.id, input="x")
        chat = await plain.post("/api/v1/chat", json={"message": "again", "conversation_id":
                                                       conversation.id.removeprefix("conv_")})  # fmt: skip
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (20, 10)  # two calls
    assert chat.json()["usage"]["total_tokens"] == 15  # one call


async def test_input_items_of_every_role_are_stored_one_by_one(target: Target) -> None:
    api = FakeResponsesAPI()
    given = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "user", "content": [
            {"type": "input_text", "text": "second"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw=="},
            {"type": "input_file", "file_id": "file-abc"},
        ]},
    ]  # fmt: skip
    async with sdk(target, api.provider()) as (client, _, _plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input=given)  # type: ignore[arg-type]
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert api.requests[0]["input"] == given  # as sent, never merged
    roles = [getattr(item, "role", item.type) for item in items]
    assert roles == ["developer", "user", "user", "reasoning", "assistant"]


async def test_a_stale_if_match_on_responses_create_commits_nothing(target: Target) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="one")
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(
                conversation=conversation.id, input="two", extra_headers={"If-Match": '"0"'}
            )
        assert refused.value.status_code == 412
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
    assert view["revision"] == 1


async def test_a_clients_function_call_and_output_appended_together_are_listed(
    target: Target,
) -> None:
    """The Agents SDK's OpenAIConversationsSession appends a call and its output in one batch:
    both must be listed (only the calls turnstore's own tools ran inside a turn are hidden)."""
    batch = [
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    ]
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        await client.conversations.items.create(conversation.id, items=batch)  # type: ignore[arg-type]
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert [item.type for item in items] == ["function_call", "function_call_output"]


async def test_the_transcript_shows_every_message_and_parts_as_placeholders(target: Target) -> None:
    given = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "input_text", "text": "look: "},
            {"type": "input_image", "image_url": "https://example.com/cat.png"},
            {"type": "input_file", "filename": "notes.pdf", "file_data": "data:application/pdf;base64,JVBERg=="},
        ]},
    ]  # fmt: skip
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input=given)  # type: ignore[arg-type]
        view = (await plain.get(f"/api/v1/conversations/{conversation.id}")).json()
    assert [(m["role"], m["content"]) for m in view["messages"]] == [
        ("developer", "Be brief."),
        ("user", "look: [image][file notes.pdf]"),
        ("assistant", "[fake-llm] look: "),
    ]


async def test_usage_and_model_are_kept_with_each_turn_and_shown_on_both_surfaces(
    target: Target,
) -> None:
    async with sdk(target, models="fake-other") as (client, _, plain):
        conversation = await client.conversations.create()
        answer = await client.responses.create(
            conversation=conversation.id, input="hello", model="fake-other"
        )
        cid = conversation.id.removeprefix("conv_")
        streamed = await plain.post(
            "/api/v1/chat/stream", json={"message": "again", "conversation_id": cid}
        )
        view = (await plain.get(f"/api/v1/conversations/{cid}")).json()
        again = await client.responses.retrieve(answer.id)
    assert answer.usage is not None
    kept = view["turns"][0]
    assert kept["model"] == "fake-other" and kept["usage"] == answer.usage.model_dump(
        exclude_none=True
    )
    assert view["turns"][1]["model"] == "fake-llm" and view["turns"][1]["usage"]["total_tokens"]
    done = [line for line in streamed.text.splitlines() if line.startswith("data:")][-1]
    assert '"usage":{"input_tokens":' in done
    assert again.usage == answer.usage


async def test_a_retrieved_response_echoes_what_its_create_did(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        made = await client.responses.create(
            conversation=conversation.id, input="hi", temperature=0.5, metadata={"a": "b"},
            tool_choice="none", max_output_tokens=100,
        )  # fmt: skip
        again = await client.responses.retrieve(made.id)
    echoed = ("created_at", "temperature", "metadata", "tool_choice", "max_output_tokens",
              "model", "usage", "output")  # fmt: skip
    assert {name: getattr(again, name) for name in echoed} == {
        name: getattr(made, name) for name in echoed
    }


async def test_tokens_are_counted_in_metrics_by_model_and_kind(target: Target) -> None:
    api = FakeResponsesAPI()

    def counted(text: str, kind: str) -> float:
        line = f'turnstore_provider_tokens_total{{kind="{kind}",model="gpt-test"}}'
        found = [row for row in text.splitlines() if row.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    async with sdk(target, api.provider()) as (client, _, plain):
        before = (await plain.get("/metrics")).text
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="x")
        after = (await plain.get("/metrics")).text
    # tests/support/fakeapi.py: 10 input, 5 output tokens of which 2 reasoning, per call.
    assert counted(after, "input") - counted(before, "input") == 10
    assert counted(after, "output") - counted(before, "output") == 5
    assert counted(after, "reasoning") - counted(before, "reasoning") == 2
