"""/v1 with real clients' shapes over PostgreSQL: tests/contracts/v1_real_shapes.py, and what only the rows show (nothing written, content deleted at once)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.ids import Ids
from tests.contracts.v1_real_shapes import *  # noqa: F403
from tests.contracts.v1_real_shapes import ENCRYPTED, OPENAI_SHAPED, dumped
from tests.support.fakeapi import FakeResponsesAPI, openai_id
from tests.support.helpers import sdk, snapshot


async def test_the_stateless_pattern_with_openai_ids_holds_over_three_calls(
    database_url: str, engine: AsyncEngine
) -> None:
    """r = create(input=hist, store=False, include=[encrypted]); hist += r.output + [next]:
    every item the provider made goes back to it as it made it (its id, its sealed content)."""
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider()) as (client, _, _plain):
        before = await snapshot(engine)
        history: list[Any] = [{"role": "user", "content": "one"}]
        for said in ("two", "three", None):
            answer = await client.responses.create(
                model="gpt-test", input=history, store=False, include=ENCRYPTED
            )
            assert answer.output_text and answer.store is False
            assert [o.type for o in answer.output] == ["reasoning", "message"]
            assert all(OPENAI_SHAPED.fullmatch(o.id) for o in answer.output)  # the provider's
            history += dumped(answer.output)
            if said is not None:
                history.append({"role": "user", "content": said})
        assert await snapshot(engine) == before  # nothing kept
    third = api.requests[2]["input"]
    assert [item.get("type", "message") for item in third] == [
        "message", "reasoning", "message", "message", "reasoning", "message", "message"
    ]  # fmt: skip
    for number, at in ((1, 1), (2, 4)):  # each reasoning item back as the provider made it
        assert third[at]["id"] == openai_id("rs", number)
        assert third[at]["encrypted_content"] == f"gAAA-sealed-{number}=="
        assert third[at + 1]["id"] == openai_id("msg", number)


async def test_store_false_after_a_stored_response_writes_nothing(
    database_url: str, engine: AsyncEngine
) -> None:
    async with sdk(database_url) as (client, _, _plain):
        stored = await client.responses.create(model="fake-llm", input="one")
        later = await client.responses.create(
            model="fake-llm", previous_response_id=stored.id, input="two"
        )
        before = await snapshot(engine)
        for previous in (stored.id, later.id):  # the latest, and an earlier one (no fork)
            relayed = await client.responses.create(
                model="fake-llm", previous_response_id=previous, input="three", store=False
            )
            assert "history=" in relayed.output_text and relayed.store is False
            assert relayed.previous_response_id == previous
        async with client.responses.stream(
            model="fake-llm", previous_response_id=later.id, input="four", store=False
        ) as stream:
            streamed = await stream.get_final_response()
        assert streamed.output_text == "[fake-llm] four (history=4)"
        assert await snapshot(engine) == before
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(previous_response_id=relayed.id, input="x")


async def test_deleting_a_stored_response_deletes_its_content_at_once(
    database_url: str, engine: AsyncEngine, ids: Ids
) -> None:
    async with sdk(database_url) as (client, _, plain):
        stored = await client.responses.create(model="fake-llm", input="a secret")
        cid = ids.parse_response(stored.id).conversation_id
        await client.responses.delete(stored.id)
        for path in (f"/api/v1/conversations/{cid}", f"/v1/conversations/conv_{cid.hex}/items"):
            assert (await plain.get(path)).status_code == 404, path
        listed = (await plain.get("/api/v1/conversations")).text
        assert str(cid) not in listed and "a secret" not in listed
        async with engine.connect() as conn:
            rows = await conn.scalar(
                text("SELECT count(*) FROM turns WHERE conversation_id = :id"), {"id": cid}
            )
        assert rows == 0
        # A chain keeps what a later response of it still holds.
        first = await client.responses.create(model="fake-llm", input="first")
        second = await client.responses.create(
            model="fake-llm", previous_response_id=first.id, input="second"
        )
        await client.responses.delete(first.id)
        assert (await client.responses.retrieve(second.id)).output_text == second.output_text
        await client.responses.delete(second.id)
        chain = ids.parse_response(second.id).conversation_id
        assert (await plain.get(f"/api/v1/conversations/{chain}")).status_code == 404


async def test_deleting_the_latest_response_of_a_stored_chain_erases_what_only_it_held(
    database_url: str, engine: AsyncEngine, ids: Ids
) -> None:
    """The earlier response stays (and its content), the deleted one's input, output and
    transcript are readable nowhere: neither on /api/v1 nor in the database (they were kept,
    marked deleted, while an earlier response of the chain lived)."""
    async with sdk(database_url) as (client, _, plain):
        first = await client.responses.create(model="fake-llm", input="kept words")
        second = await client.responses.create(
            model="fake-llm", previous_response_id=first.id, input="secret words"
        )
        cid = ids.parse_response(second.id).conversation_id
        await client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(second.id)
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        transcript = (await plain.get(f"/api/v1/conversations/{cid}")).text
        assert "kept words" in transcript and "secret words" not in transcript
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT t::text FROM turns t"))).scalars().all()
        assert any("kept words" in row for row in rows)
        assert not any("secret words" in row for row in rows)
        again = await client.responses.create(
            model="fake-llm", previous_response_id=first.id, input="after it"
        )  # the chain goes on from the earlier response (on a fork of it)
        assert again.output_text == "[fake-llm] after it (history=2)"


async def test_input_tokens_are_counted_by_the_provider_with_the_stored_history(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    async with sdk(database_url, api.provider()) as (client, _, _plain):
        before = await snapshot(engine)
        alone = await client.responses.input_tokens.count(model="gpt-test", input="hello")
        assert (alone.object, alone.input_tokens) == ("response.input_tokens", 10)
        stored = await client.responses.create(model="gpt-test", input="hello")
        before = await snapshot(engine)
        api.anew()
        chained = await client.responses.input_tokens.count(
            model="gpt-test", previous_response_id=stored.id, input="more",
            instructions="Be brief.", tools=[],
        )  # fmt: skip
        # The history (its message, reasoning and answer) and the new message: four items.
        assert chained.input_tokens == 40
        sent = api.requests[-1]
        assert api.urls[-1].endswith("/responses/input_tokens")
        assert [i.get("type", "message") for i in sent["input"]] == [
            "message", "reasoning", "message", "message"
        ]  # fmt: skip
        assert sent["instructions"] == "Be brief." and "store" not in sent
        assert await snapshot(engine) == before  # nothing committed
    async with sdk(database_url) as (client, _, _plain):  # the built-in fake counts too
        counted = await client.responses.input_tokens.count(model="fake-llm", input="hello")
        made = await client.responses.create(model="fake-llm", input="hello")  # what it counted
        assert made.usage is not None and counted.input_tokens == made.usage.input_tokens
