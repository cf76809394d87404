"""Each Python client on top of the openai SDK as its documentation shows it, against a served
turnstore's /v1 (issue "20."): the OpenAI Agents SDK (instructions, model settings, a function
tool the SDK runs itself, over a conversation and over ``OpenAIConversationsSession``, run and
streamed) and LangChain's ``ChatOpenAI(use_responses_api=True)`` (a system message in a
conversation, invoke and stream, tools, structured output).

Where a test must see what reached the provider it runs over the fake Responses API
(tests/support/fakeapi.py, which records each request the real adapter sends and reports 10 input and
5 output tokens per call); elsewhere over the built-in fake, which refuses fields the Responses
API does not have, checks sealed reasoning and answers tools and schemas itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pydantic
import pytest
from agent_framework_openai import OpenAIChatClient
from agents import (
    Agent,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    Runner,
)
from agents.memory import OpenAIConversationsSession
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai.types.shared import Reasoning
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider as PydanticOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.agents_sdk import get_weather, ran
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import sdk

# Model settings a client sets on an agent, and the request fields they become.
SETTINGS = ModelSettings(
    temperature=0.3, top_p=0.9, max_tokens=50, tool_choice="auto", parallel_tool_calls=False,
    truncation="auto",
    reasoning=Reasoning(effort="low"), verbosity="low", metadata={"run": "r1"},
    prompt_cache_retention="24h", top_logprobs=2,
    extra_args={"user": "u-1", "safety_identifier": "s-1", "service_tier": "flex",
                "prompt_cache_key": "k-1", "max_tool_calls": 3},
)  # fmt: skip
SENT = {
    "temperature": 0.3, "top_p": 0.9, "max_output_tokens": 50, "tool_choice": "auto",
    "parallel_tool_calls": False, "reasoning": {"effort": "low"}, "text": {"verbosity": "low"},
    "metadata": {"run": "r1"}, "prompt_cache_retention": "24h", "top_logprobs": 2,
    "user": "u-1", "safety_identifier": "s-1", "service_tier": "flex", "prompt_cache_key": "k-1",
    "max_tool_calls": 3,
}  # fmt: skip
# What a Response echoes of them (the contract's list).
ECHOED = (
    "temperature", "top_p", "max_output_tokens", "tool_choice", "parallel_tool_calls", "text",
    "reasoning", "metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key",
)  # fmt: skip


@asynccontextmanager
async def agents_on(
    database_url: str, provider: Any = None, **settings: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, RunConfig]]:
    """A served turnstore and the run config that points the Agents SDK's models at it."""
    async with sdk(database_url, provider, **settings) as (client, _, _plain):
        provider_of_models = OpenAIProvider(openai_client=client, use_responses=True)
        yield client, RunConfig(model_provider=provider_of_models)


def weather_agent(model: str, settings: ModelSettings = SETTINGS) -> Agent[Any]:
    return Agent(
        name="forecaster", instructions="Be terse.", model=model, model_settings=settings,
        tools=[get_weather],
    )  # fmt: skip


def kinds(request: dict[str, Any]) -> list[str]:
    return [item.get("type", "message") for item in request["input"]]


async def test_an_agent_over_a_conversation_runs_its_tool_and_forwards_its_settings(
    database_url: str, engine: AsyncEngine
) -> None:
    ran.clear()
    api = FakeResponsesAPI().then(
        Script(calls=[("get_weather", '{"city": "Paris"}')]), Script(text="Sunny in Paris.")
    )
    async with agents_on(database_url, api.provider()) as (client, run_config):
        conversation = await client.conversations.create()
        result = await Runner.run(
            weather_agent("gpt-test"), "weather in Paris?", conversation_id=conversation.id,
            run_config=run_config,
        )  # fmt: skip
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
    assert ran == ["Paris"]  # the SDK ran the tool, then sent its output
    assert result.final_output == "Sunny in Paris."
    first, second = api.requests
    assert {name: first.get(name) for name in SENT} == SENT
    # The SDK drops tool_choice once a tool ran (Agent.reset_tool_choice), the rest stays.
    assert {name: second.get(name) for name in SENT} == {**SENT, "tool_choice": None}
    for sent in (first, second):
        assert sent["instructions"] == "Be terse."  # on each call: they are not history
        assert [tool["name"] for tool in sent["tools"]] == ["get_weather"]
        assert "message.output_text.logprobs" in sent["include"]
    # The follow-up brought only the output; turnstore put the call back before it.
    assert kinds(second) == ["message", "reasoning", "function_call", "function_call_output"]
    assert second["input"][-1]["output"] == "sunny in Paris"
    assert [getattr(i, "role", i.type) for i in items] == [
        "user", "reasoning", "function_call", "function_call_output", "reasoning", "assistant"
    ]  # fmt: skip
    usage = result.context_wrapper.usage  # the provider's, two calls of 10 in and 5 out
    assert (usage.requests, usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        2, 20, 10, 30
    )  # fmt: skip


async def test_a_streamed_agent_run_sees_its_settings_echoed_and_the_providers_usage(
    database_url: str, engine: AsyncEngine
) -> None:
    ran.clear()
    api = FakeResponsesAPI().then(
        Script(calls=[("get_weather", '{"city": "Oslo"}')]), Script(text="Sunny in Oslo.")
    )
    async with agents_on(database_url, api.provider()) as (client, run_config):
        conversation = await client.conversations.create()
        streamed = Runner.run_streamed(
            weather_agent("gpt-test"), "weather in Oslo?", conversation_id=conversation.id,
            run_config=run_config,
        )  # fmt: skip
        completed, text = [], ""
        async for event in streamed.stream_events():
            if event.type != "raw_response_event":
                continue
            if event.data.type == "response.completed":
                completed.append(event.data.response)
            elif event.data.type == "response.output_text.delta":
                text += event.data.delta
    assert ran == ["Oslo"]
    assert (streamed.final_output, text) == ("Sunny in Oslo.", "Sunny in Oslo.")
    assert all(request["stream"] is True for request in api.requests)
    for response in completed:  # each of the two calls' Response echoes what was sent
        shown = response.model_dump(exclude_none=True)
        assert {name: shown.get(name) for name in ECHOED} == {name: SENT[name] for name in ECHOED}
        assert (response.instructions, response.truncation) == ("Be terse.", "auto")
        assert response.usage is not None and response.usage.total_tokens == 15
    usage = streamed.context_wrapper.usage
    assert (usage.requests, usage.input_tokens, usage.output_tokens) == (2, 20, 10)


async def test_an_agent_over_a_conversations_session_keeps_its_tool_turns(
    database_url: str, engine: AsyncEngine
) -> None:
    """The session sends the whole history on calls without a conversation and appends the
    new items itself (the tool call and its output in one batch); the built-in fake checks
    that every sealed reasoning item it gets back is its own."""
    ran.clear()
    async with agents_on(database_url) as (client, run_config):
        conversation = await client.conversations.create()
        session = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
        agent = weather_agent("fake-llm", ModelSettings(temperature=0.3, max_tokens=50))
        first = await Runner.run(
            agent, 'call get_weather {"city": "Rome"}', session=session, run_config=run_config
        )
        second = await Runner.run(agent, "and tomorrow?", session=session, run_config=run_config)
        stored = await session.get_items()
    assert ran == ["Rome"]
    assert (
        first.final_output == '[fake-llm] call get_weather {"city": "Rome"} [tool: sunny in Rome]'
    )
    assert second.final_output == "[fake-llm] and tomorrow? (history=2)"
    assert [item.get("type", "message") for item in stored] == [
        "message", "reasoning", "function_call", "function_call_output", "reasoning", "message",
        "message", "reasoning", "message",
    ]  # fmt: skip
    # The built-in fake's usage: 4 reasoning tokens per call, and a token per 4 characters.
    usage = second.context_wrapper.usage
    reply = len("[fake-llm] and tomorrow? (history=2)")
    assert (usage.requests, usage.output_tokens) == (1, -(-reply // 4) + 4)
    assert usage.output_tokens_details.reasoning_tokens == 4
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > usage.output_tokens


async def test_an_agent_with_a_prompt_template_sends_it_as_it_came(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI().then(Script(text="From the template."))
    prompt = {"id": "pmpt_1", "version": "2", "variables": {"city": "Paris"}}
    async with agents_on(database_url, api.provider()) as (_client, run_config):
        agent = Agent(name="templated", prompt=prompt, model="gpt-test")  # type: ignore[arg-type]
        result = await Runner.run(agent, "go", run_config=run_config)
    assert result.final_output == "From the template."
    assert api.requests[0]["prompt"] == prompt


async def test_an_agent_chains_its_calls_with_auto_previous_response_id(
    database_url: str, engine: AsyncEngine
) -> None:
    ran.clear()
    async with agents_on(database_url) as (_client, run_config):
        agent = weather_agent("fake-llm", ModelSettings(temperature=0.3))
        result = await Runner.run(
            agent, 'call get_weather {"city": "Lima"}', auto_previous_response_id=True,
            run_config=run_config,
        )  # fmt: skip
    assert ran == ["Lima"]
    assert str(result.final_output).endswith("[tool: sunny in Lima]")


async def test_a_streamed_agent_run_over_a_conversations_session(
    database_url: str, engine: AsyncEngine
) -> None:
    async with agents_on(database_url) as (client, run_config):
        conversation = await client.conversations.create()
        session = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
        agent = Agent(name="a", instructions="Be terse.", model="fake-llm")
        streamed = Runner.run_streamed(agent, "one", session=session, run_config=run_config)
        async for _ in streamed.stream_events():
            pass
    assert streamed.final_output == "[fake-llm] one"


@pytest.mark.parametrize("store", [False, None], ids=["store=False", "stored responses"])
async def test_a_handoff_between_agents_on_two_models(
    database_url: str, engine: AsyncEngine, store: bool | None
) -> None:
    """The first agent's answer (its reasoning, sealed for its model) is in the history the
    second agent's model gets: turnstore leaves it out, as in a conversation (the built-in
    fake refuses another model's seal, as the API does)."""
    async with agents_on(database_url, models="*") as (_client, run_config):
        specialist = Agent(
            name="specialist", instructions="Answer.", model="model-b",
            model_settings=ModelSettings(store=store),
        )  # fmt: skip
        triage = Agent(
            name="triage", instructions="Hand off.", model="model-a", handoffs=[specialist],
            model_settings=ModelSettings(store=store, tool_choice="transfer_to_specialist"),
        )  # fmt: skip
        result = await Runner.run(triage, "a question", run_config=run_config)
        assert result.last_agent is specialist
        assert str(result.final_output).startswith("[fake-llm] a question")
        # And back: the specialist's own history goes on with its own model.
        again = await Runner.run(
            specialist, [*result.to_input_list(), {"role": "user", "content": "more"}],
            run_config=run_config,
        )  # fmt: skip
        assert str(again.final_output).startswith("[fake-llm] more")


# LangChain --------------------------------------------------------------------------------


def weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


def chat_model(url: str, **options: Any) -> ChatOpenAI:
    options = {"model": "gpt-test", **options}
    return ChatOpenAI(
        use_responses_api=True, base_url=f"{url}/v1", api_key="x", max_retries=0, **options,  # type: ignore[arg-type]
    )  # fmt: skip


@asynccontextmanager
async def served(
    database_url: str, provider: Any = None, **settings: Any
) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    async with sdk(database_url, provider, **settings) as (client, _, _plain):
        yield str(client.base_url).removesuffix("/v1/"), client


async def test_langchain_with_a_system_message_in_a_conversation(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI().then(Script(text="Bonjour."), Script(text="Encore."))
    async with served(database_url, api.provider()) as (url, client):
        conversation = await client.conversations.create()
        llm = chat_model(
            url, temperature=0.2, top_p=0.5, max_tokens=40, service_tier="flex",
            reasoning={"effort": "low"}, extra_body={"metadata": {"run": "lc"}},
            model_kwargs={"conversation": conversation.id, "user": "u-2", "prompt_cache_key": "k-2"},
        )  # fmt: skip
        first = await asyncio.to_thread(
            llm.invoke, [SystemMessage("Answer in French."), HumanMessage("hello")]
        )
        later = await asyncio.to_thread(llm.invoke, [HumanMessage("more")])
    assert (first.text, later.text) == ("Bonjour.", "Encore.")
    sent = {
        "temperature": 0.2, "top_p": 0.5, "max_output_tokens": 40, "service_tier": "flex",
        "reasoning": {"effort": "low"}, "metadata": {"run": "lc"}, "user": "u-2",
        "prompt_cache_key": "k-2",
    }  # fmt: skip
    assert {name: api.requests[0].get(name) for name in sent} == sent
    assert api.requests[0]["input"][0] == {
        "type": "message", "role": "system", "content": "Answer in French."
    }  # fmt: skip
    # The second turn's history: the first turn's system and user messages, its reasoning and
    # answer, then the new message.
    assert kinds(api.requests[1]) == ["message", "message", "reasoning", "message", "message"]
    shown = first.response_metadata
    assert {name: shown[name] for name in ("metadata", "user", "service_tier", "model")} == {
        "metadata": {"run": "lc"}, "user": "u-2", "service_tier": "flex", "model": "gpt-test"
    }  # fmt: skip
    assert first.usage_metadata is not None
    assert (
        first.usage_metadata["input_tokens"], first.usage_metadata["output_tokens"],
        first.usage_metadata["total_tokens"],
    ) == (10, 5, 15)  # fmt: skip


async def test_langchain_streams_in_a_conversation(database_url: str, engine: AsyncEngine) -> None:
    api = FakeResponsesAPI().then(Script(text="streamed reply", deltas=3))
    async with served(database_url, api.provider()) as (url, client):
        conversation = await client.conversations.create()
        llm = chat_model(
            url, temperature=0.7,
            model_kwargs={"conversation": conversation.id,
                          "stream_options": {"include_obfuscation": False}},
        )  # fmt: skip

        def stream() -> Any:
            chunks = list(llm.stream([SystemMessage("Be brief."), HumanMessage("go")]))
            whole = chunks[0]
            for chunk in chunks[1:]:
                whole += chunk
            return chunks, whole

        chunks, whole = await asyncio.to_thread(stream)
    assert whole.text == "streamed reply" and len(chunks) > 3
    sent = api.requests[0]
    assert (sent["stream"], sent["temperature"], sent["stream_options"]) == (
        True, 0.7, {"include_obfuscation": False}
    )  # fmt: skip
    assert whole.usage_metadata is not None and whole.usage_metadata["total_tokens"] == 15


async def test_langchain_streams_without_a_conversation(
    database_url: str, engine: AsyncEngine
) -> None:
    async with served(database_url) as (url, _client):
        llm = chat_model(url, model="fake-llm", temperature=0.7)
        text = await asyncio.to_thread(lambda: "".join(c.text for c in llm.stream("go")))
    assert text == "[fake-llm] go"


async def test_langchain_tools_in_a_conversation(database_url: str, engine: AsyncEngine) -> None:
    ran.clear()
    async with served(database_url) as (url, client):
        conversation = await client.conversations.create()
        llm = chat_model(url, model="fake-llm", model_kwargs={"conversation": conversation.id})
        with_tools = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False)
        asked = await asyncio.to_thread(with_tools.invoke, [HumanMessage("Oslo")])
        call = asked.tool_calls[0]
        assert (call["name"], call["args"]) == ("weather", {"city": "Oslo"})
        output = ToolMessage(weather(**call["args"]), tool_call_id=call["id"])
        answered = await asyncio.to_thread(llm.bind_tools([weather]).invoke, [output])
    assert answered.text == "[fake-llm] Oslo [tool: sunny in Oslo]"
    assert asked.response_metadata["model"] == "fake-llm"


async def test_langchain_tools_without_a_conversation(
    database_url: str, engine: AsyncEngine
) -> None:
    """The client keeps the history: the call's reasoning comes back sealed, as it got it."""
    async with served(database_url) as (url, _client):
        llm = chat_model(url, model="fake-llm").bind_tools([weather])
        history: list[Any] = [HumanMessage('call weather {"city": "Lima"}')]
        asked = await asyncio.to_thread(llm.invoke, history)
        call = asked.tool_calls[0]
        history += [asked, ToolMessage(weather(**call["args"]), tool_call_id=call["id"])]
        answered = await asyncio.to_thread(llm.invoke, history)
    assert answered.text == '[fake-llm] call weather {"city": "Lima"} [tool: sunny in Lima]'


@pytest.mark.parametrize("store", [True, False])
async def test_langchain_streams_the_reasoning_item(
    database_url: str, engine: AsyncEngine, store: bool
) -> None:
    """The stream announces the reasoning item (OpenAI's order: before the message), so the
    streamed message holds its reasoning block, and a stateless history sent back with it
    goes on."""
    async with served(database_url) as (url, _client):
        llm = chat_model(
            url, model="fake-llm", store=store, include=["reasoning.encrypted_content"]
        )

        def stream(messages: list[Any]) -> Any:
            chunks = list(llm.stream(messages))
            whole = chunks[0]
            for chunk in chunks[1:]:
                whole += chunk
            return whole

        first = await asyncio.to_thread(stream, [HumanMessage("one")])
        assert [block["type"] for block in first.content_blocks] == ["reasoning", "text"]
        history = [HumanMessage("one"), first, HumanMessage("two")]
        second = await asyncio.to_thread(stream, history)
    assert second.text == "[fake-llm] two (history=2)"


class City(pydantic.BaseModel):
    name: str
    population: int


async def test_langchain_structured_output(database_url: str, engine: AsyncEngine) -> None:
    async with served(database_url) as (url, client):
        conversation = await client.conversations.create()
        llm = chat_model(url, model="fake-llm", model_kwargs={"conversation": conversation.id})
        city = await asyncio.to_thread(
            llm.with_structured_output(City).invoke,
            [SystemMessage("Answer with a city."), HumanMessage("Paris")],
        )
        stateless = await asyncio.to_thread(
            chat_model(url, model="fake-llm").with_structured_output(City).invoke, "Rome"
        )
    assert isinstance(city, City) and city.name.startswith("[fake-llm] Paris")
    assert isinstance(stateless, City) and stateless.name.startswith("[fake-llm] Rome")


# Pydantic AI and the Microsoft Agent Framework (their OpenAI Responses clients) -----------------


async def test_pydantic_ai_runs_a_tool_keeps_its_history_and_streams(
    database_url: str, engine: AsyncEngine
) -> None:
    async with served(database_url) as (url, _client):
        model = OpenAIResponsesModel(
            "gpt-5.2", provider=PydanticOpenAI(base_url=f"{url}/v1", api_key="x")
        )
        agent: PydanticAgent[None, str] = PydanticAgent(model, instructions="Be terse.")
        called: list[str] = []

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Weather in a city."""
            called.append(city)
            return f"sunny in {city}"

        first = await agent.run("hello")
        assert first.output == "[fake-llm] hello"
        second = await agent.run(
            'call get_weather {"city": "Oslo"}', message_history=first.all_messages()
        )
        assert called == ["Oslo"]
        assert (
            second.output
            == '[fake-llm] call get_weather {"city": "Oslo"} (history=2) [tool: sunny in Oslo]'
        )
        async with agent.run_stream("streamed") as streamed:
            text = "".join([delta async for delta in streamed.stream_text(delta=True)])
        assert text == "[fake-llm] streamed"


async def test_the_agent_frameworks_responses_client_runs_a_tool_and_streams(
    database_url: str, engine: AsyncEngine
) -> None:
    called: list[str] = []

    def forecast(city: str) -> str:
        """Weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async with served(database_url) as (url, _client):
        client = OpenAIChatClient(model="gpt-5.2", base_url=f"{url}/v1", api_key="x")
        agent = client.as_agent(instructions="Be terse.", tools=[forecast])
        assert (await agent.run("hello")).text == "[fake-llm] hello"
        answered = await agent.run('call forecast {"city": "Lima"}')
        assert called == ["Lima"]
        assert answered.text == '[fake-llm] call forecast {"city": "Lima"} [tool: sunny in Lima]'
        updates = [update async for update in agent.run("streamed", stream=True)]
        deltas = [u.text for u in updates if u.text]
        assert "".join(deltas[:-1]) == "[fake-llm] streamed"  # the deltas, then the whole text
        assert deltas[-1] == "[fake-llm] streamed"
