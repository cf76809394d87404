"""A /v1 response's life ("Responses: stored, chained, streamed"): stored by default, chained
by previous_response_id, relayed without a trace with store: false, streamed for every kind of
call, run in the background, resumed, cancelled, deleted, its input items paged, expired.

The official SDK under strict validation; real `turnstore serve` replicas on one database and
the fake Responses API over loopback HTTP for what crosses processes (another replica chains,
polls, resumes and cancels; a replica is killed under a background response)."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from service.core.ids import Ids
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import Target, sdk


def conversation_of(ids: Ids, response_id: str) -> uuid.UUID:
    return ids.parse_response(response_id).conversation_id


# --- one replica ---------------------------------------------------------------------------


async def test_a_response_without_a_conversation_is_stored_and_chained(
    target: Target, ids: Ids
) -> None:
    api = FakeResponsesAPI()
    async with sdk(target, api.provider()) as (client, _, _plain):
        first = await client.responses.create(input="hello", instructions="Be brief.")
        assert first.status == "completed" and first.store is True
        assert first.conversation is None  # as on OpenAI: a stored response has none
        again = await client.responses.retrieve(first.id)
        # The same Response, every time, but for the instructions: a turn keeps their digest
        # only (the contract's Responses: what a request may carry), so a retrieve shows none.
        assert again.model_dump() == {**first.model_dump(), "instructions": None}
        second = await client.responses.create(previous_response_id=first.id, input="more")
        # The model saw the first exchange, byte for byte, then the new message; the
        # instructions were the first response's alone.
        assert api.requests[1]["input"][:-1] == [*api.requests[0]["input"], *first_output(api)]
        assert "instructions" not in api.requests[1]
        assert second.previous_response_id == first.id
        assert conversation_of(ids, second.id) == conversation_of(ids, first.id)
        third = await client.responses.create(previous_response_id=first.id, input="edited")
        assert conversation_of(ids, third.id) != conversation_of(
            ids, first.id
        )  # an earlier one: a fork


def first_output(api: FakeResponsesAPI) -> list[Any]:
    """What the provider answered the first call, as its next input carries it."""
    return list(api.requests[1]["input"][len(api.requests[0]["input"]) : -1])


async def test_every_kind_of_call_streams_with_the_sdk_helper(target: Target, ids: Ids) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        kinds: dict[str, dict[str, Any]] = {
            "stored": {},
            "stateless": {"store": False},
            "in a conversation": {"conversation": conversation.id},
        }
        finals = {}
        for kind, fields in kinds.items():
            async with client.responses.stream(
                input=f"say {kind}", model="fake-llm", **fields
            ) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert final.status == "completed" and "".join(deltas) == final.output_text, kind
            finals[kind] = final
        chained = finals["stored"].id
        async with client.responses.stream(
            previous_response_id=chained, input="on", model="fake-llm"
        ) as stream:
            final = await stream.get_final_response()
        assert conversation_of(ids, final.id) == conversation_of(ids, chained)
        for kind in ("stored", "in a conversation"):  # kept: retrieved as streamed
            kept = await client.responses.retrieve(finals[kind].id)
            assert kept.output_text == finals[kind].output_text
            assert kept.created_at == finals[kind].created_at


async def test_delete_forgets_the_response_and_keeps_the_conversations_items(
    target: Target,
) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        response = await client.responses.create(conversation=conversation.id, input="one")
        items = [i.id async for i in client.conversations.items.list(conversation.id)]
        deleted = await client.responses.delete(response.id)
        assert deleted is None  # the SDK answers None for OpenAI's {"id", "deleted": true}
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(response.id)
        with pytest.raises(openai.BadRequestError) as chained:
            await client.responses.create(previous_response_id=response.id, input="two")
        assert chained.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(response.id)
        assert [i.id async for i in client.conversations.items.list(conversation.id)] == items
        # The conversation goes on.
        later = await client.responses.create(conversation=conversation.id, input="two")
        assert later.status == "completed"


async def test_input_items_page_like_openais(target: Target) -> None:
    said = [f"message {n}" for n in range(7)]
    async with sdk(target) as (client, _, _plain):
        response = await client.responses.create(
            input=[{"role": "user", "content": text} for text in said]
        )
        first = await client.responses.input_items.list(response.id, limit=3)
        assert first.has_more and len(first.data) == 3  # newest first by default
        newest_first = [i.content[0].text async for i in  # type: ignore[union-attr]
                        client.responses.input_items.list(response.id, limit=3)]  # fmt: skip
        assert newest_first == said[::-1]  # the SDK followed `after` across three pages
        oldest_first = await client.responses.input_items.list(
            response.id, order="asc", after=first.data[-1].id, limit=100
        )
        assert [i.content[0].text for i in oldest_first.data] == said[5:]  # type: ignore[union-attr]
        assert not oldest_first.has_more
        ascending = [i.content[0].text async for i in  # type: ignore[union-attr]
                     client.responses.input_items.list(response.id, order="asc", limit=2)]  # fmt: skip
        assert ascending == said
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_items.list(response.id, limit=101)
        assert refused.value.param == "limit"


# --- replicas --------------------------------------------------------------------------------
