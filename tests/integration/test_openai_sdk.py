"""The official openai SDK against turnstore over PostgreSQL: tests/contracts/openai_sdk.py, and
what needs the database: a stale writer whose lease ran out, raw stream ids."""

from __future__ import annotations

import asyncio

import openai
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.contracts.openai_sdk import *  # noqa: F403
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import (
    failing_renewals,
    sdk,
    until_lease_expired,
)


async def test_a_raw_stream_numbers_its_events_and_ends_once(
    database_url: str, engine: AsyncEngine
) -> None:
    async with sdk(database_url) as (client, _, _plain):
        conversation = await client.conversations.create()
        stream = await client.responses.create(
            conversation=conversation.id, input="raw", stream=True
        )
        events = [event async for event in stream]
        numbers = [event.sequence_number for event in events]
        assert numbers == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        terminal = {"response.completed", "response.incomplete", "response.failed", "error"}
        assert sum(event.type in terminal for event in events) == 1
        ids = {
            e.response.id
            for e in events
            if e.type.startswith("response.") and hasattr(e, "response")
        }
        assert len(ids) == 1


async def test_a_stale_writer_gets_one_conflict_and_the_sdk_does_not_retry_it(
    database_url: str, engine: AsyncEngine
) -> None:
    api = FakeResponsesAPI()
    common = {"turn_lease_s": 1}
    stale_store = failing_renewals(engine)
    async with (
        sdk(database_url, api.provider(), store=stale_store, max_retries=2, **common) as (
            a,
            wire,
            _,
        ),
        sdk(database_url, api.provider(), **common) as (b, _, _plain),
    ):
        conversation = await a.conversations.create()
        await a.responses.create(conversation=conversation.id, input="first")
        a_gate, b_gate = asyncio.Event(), asyncio.Event()
        a_slow, b_slow = Script(gate=a_gate), Script(gate=b_gate)
        api.then(a_slow)
        sent = len(wire)
        a_turn = asyncio.create_task(
            a.responses.create(conversation=conversation.id, input="stale")
        )
        await a_slow.started.wait()
        await until_lease_expired(engine, conversation.id.removeprefix("conv_"))
        api.then(b_slow)
        b_turn = asyncio.create_task(
            b.responses.create(conversation=conversation.id, input="took it")
        )
        await b_slow.started.wait()
        a_gate.set()
        with pytest.raises(openai.ConflictError) as conflict:
            await a_turn
        assert conflict.value.code == "conversation_conflict"
        assert conflict.value.response.headers["x-should-retry"] == "false"
        assert len(wire) - sent == 1  # the SDK's default retries did not run the turn again
        b_gate.set()
        assert (await b_turn).output_text
