"""The OpenAI Agents SDK (``openai-agents``) with turnstore as its conversation state: the
server-managed mode (``Runner.run(..., conversation_id=...)``, the SDK sends only new items)
with a client-side function tool, and ``OpenAIConversationsSession`` storing items, from two
replicas at once. Tracing is off; the model is turnstore's built-in fake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner
from agents.memory import OpenAIConversationsSession

from service.app import create_app
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from tests.support.agents_sdk import get_weather, ran
from tests.support.helpers import serve


@asynccontextmanager
async def turnstore(database_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(Settings(database_url=database_url), provider=FakeProvider())
    async with serve(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            yield client
        finally:
            await client.close()


def agent(client: openai.AsyncOpenAI, **kw: Any) -> Agent[Any]:
    model = OpenAIResponsesModel(model="fake-llm", openai_client=client)
    return Agent(name="assistant", model=model, **kw)


async def test_runs_on_a_conversation_see_the_whole_history(database_url: str) -> None:
    async with turnstore(database_url) as client:
        conversation = await client.conversations.create()
        answers = [
            (await Runner.run(agent(client), text, conversation_id=conversation.id)).final_output
            for text in ("one", "two", "three")
        ]
        assert answers == [
            "[fake-llm] one", "[fake-llm] two (history=2)", "[fake-llm] three (history=4)"
        ]  # fmt: skip


async def test_a_client_side_tool_runs_in_the_agent_and_its_answer_is_kept(
    database_url: str,
) -> None:
    ran.clear()
    async with turnstore(database_url) as client:
        conversation = await client.conversations.create()
        weather = agent(client, tools=[get_weather])
        result = await Runner.run(
            weather, 'call get_weather {"city": "Oslo"}', conversation_id=conversation.id
        )
        assert ran == ["Oslo"]  # the SDK ran the tool, not turnstore
        assert str(result.final_output).endswith("[tool: sunny in Oslo]")
        later = await Runner.run(weather, "and now?", conversation_id=conversation.id)
        assert (
            later.final_output == "[fake-llm] and now? (history=2)"
        )  # the call turn: 1 user, 1 answer
        kinds = [
            i.type async for i in client.conversations.items.list(conversation.id, order="asc")
        ]
        assert kinds == [
            "message", "reasoning", "function_call", "function_call_output", "reasoning",
            "message", "message", "reasoning", "message",
        ]  # fmt: skip


async def test_a_conversations_session_stores_lists_and_clears_items(database_url: str) -> None:
    async with turnstore(database_url) as client:
        conversation = await client.conversations.create()
        session = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
        said = [{"role": "user", "content": f"note {n}"} for n in range(25)]
        await session.add_items(said)  # type: ignore[arg-type]  # two requests: 20, then 5
        items = await session.get_items()
        assert [text_of(item) for item in items] == [f"note {n}" for n in range(25)]
        assert [text_of(item) for item in await session.get_items(limit=2)] == [
            "note 23",
            "note 24",
        ]
        await session.clear_session()
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conversation.id)


async def test_session_managed_runs_relay_the_history_with_its_sealed_reasoning(
    database_url: str,
) -> None:
    """The session lists items without encrypted_content and sends them back on a call
    without a conversation: turnstore puts the stored reasoning back (the fake provider
    refuses reasoning whose seal it cannot check)."""
    async with turnstore(database_url) as client:
        conversation = await client.conversations.create()
        session = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
        first = await Runner.run(agent(client), "one", session=session)
        second = await Runner.run(agent(client), "two", session=session)
        assert (first.final_output, second.final_output) == (
            "[fake-llm] one", "[fake-llm] two (history=2)"
        )  # fmt: skip
        kinds = [item.get("type", "message") for item in await session.get_items()]
        assert kinds == ["message", "reasoning", "message"] * 2
        someone_elses = {"type": "item_reference", "id": "rs_not_yours"}
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(input=[someone_elses], model="fake-llm")  # type: ignore[list-item]
        assert refused.value.param == "input"


async def test_pop_item_removes_the_latest_item_on_every_replica(database_url: str) -> None:
    async with turnstore(database_url) as a, turnstore(database_url) as b:
        conversation = await a.conversations.create()
        on_a = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=a)
        on_b = OpenAIConversationsSession(conversation_id=conversation.id, openai_client=b)
        await Runner.run(agent(a), "one", session=on_a)  # replica A caches the history
        await on_a.add_items([{"role": "user", "content": "oops"}])  # type: ignore[list-item]
        popped = await on_b.pop_item()  # on the other replica
        assert popped is not None and text_of(popped) == "oops"
        assert [text_of(i) for i in await on_a.get_items() if i.get("type") == "message"][-1] == (
            "[fake-llm] one"
        )
        answer = await Runner.run(agent(a), "two", session=on_a)  # A reads afresh
        assert answer.final_output == "[fake-llm] two (history=2)"
        await on_a.pop_item()  # the last answer's message
        first = (await on_a.get_items())[0]
        with pytest.raises(openai.BadRequestError) as refused:
            await a.conversations.items.delete(first["id"], conversation_id=conversation.id)  # type: ignore[typeddict-item]
        assert refused.value.param == "item_id"


def text_of(item: Any) -> str:
    content = item["content"]
    return str(content if isinstance(content, str) else content[0]["text"])


async def test_two_sessions_on_two_replicas_never_interleave_their_writes(
    database_url: str,
) -> None:
    async with turnstore(database_url) as a, turnstore(database_url) as b:
        conversation = await a.conversations.create()
        sessions = {
            name: OpenAIConversationsSession(conversation_id=conversation.id, openai_client=client)
            for name, client in (("a", a), ("b", b))
        }

        async def write(name: str, n: int) -> str | None:
            batch = [{"role": "user", "content": f"{name}{n}.{part}"} for part in range(3)]
            try:
                await sessions[name].add_items(batch)  # type: ignore[arg-type]
            except openai.ConflictError as lost:
                assert lost.code == "conversation_conflict"
                return None
            return f"{name}{n}"

        results = await asyncio.gather(*(write(name, n) for n in range(10) for name in "ab"))
        # Whether a write loses depends on timing; whoever lost wrote nothing, whoever won
        # wrote its whole batch, once, in one piece.
        kept = [label for label in results if label is not None]
        assert kept
        texts = [text_of(item) for item in await sessions["a"].get_items()]
        assert len(texts) == 3 * len(kept)
        batches = [texts[i : i + 3] for i in range(0, len(texts), 3)]
        assert all(batch == [f"{batch[0][:-2]}.{part}" for part in range(3)] for batch in batches)
        assert sorted(batch[0][:-2] for batch in batches) == sorted(kept)
