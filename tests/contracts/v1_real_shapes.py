"""/v1 as the real OpenAI answers it (issue 29): the provider's own ids (a prefix and 48 hex
digits) sent back as they came, turnstore's own ids opaque, reasoning announced in streams at
its place in the final output, another model's sealed content left out of a stateless call,
``store: false`` after a stored response writing nothing, a deleted stored response gone at
once, ``input_tokens``, and a conversation's compaction item listed.

Over the fake Responses API (tests/support/fakeapi.py: it mints OpenAI-shaped ids, and records every
request the real adapter sends) and the built-in fake (which checks sealed content), served
over loopback HTTP on real PostgreSQL, with the official SDK's strict parsing.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import openai
import pytest

from service.core.ids import Ids
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import Target, sdk

OPENAI_SHAPED = re.compile(r"[a-z]+_[0-9a-f]{48}")
ENCRYPTED = ["reasoning.encrypted_content"]


def dumped(output: Any) -> list[dict[str, Any]]:
    """A Response's output as the docs' stateless pattern sends it back."""
    return [item.model_dump(exclude_none=True) for item in output]


async def test_the_stateless_pattern_holds_on_the_built_in_fake(target: Target) -> None:
    """`make run`'s provider checks its seals: what it gets back must be what it sealed."""
    async with sdk(target) as (client, _, _plain):
        history: list[Any] = [{"role": "user", "content": "one"}]
        for said in ("two", "three"):
            answer = await client.responses.create(
                model="fake-llm", input=history, store=False, include=ENCRYPTED
            )
            assert all(OPENAI_SHAPED.fullmatch(o.id) for o in answer.output)
            history += [*dumped(answer.output), {"role": "user", "content": said}]
        last = await client.responses.create(model="fake-llm", input=history, store=False)
    assert last.output_text == "[fake-llm] three (history=4)"


async def test_turnstores_own_ids_are_opaque(target: Target, ids: Ids) -> None:
    async with sdk(target) as (client, _, plain):
        conversation = await client.conversations.create()
        responses = [
            await client.responses.create(conversation=conversation.id, input=said)
            for said in ("one", "two")
        ]
        stored = await client.responses.create(input="stored")
        items = [i async for i in client.conversations.items.list(conversation.id)]
        hexes = {
            conversation.id.removeprefix("conv_"),
            ids.parse_response(stored.id).conversation_id.hex,
        }
        minted = [r.id for r in (*responses, stored)] + [i.id for i in items]  # type: ignore[union-attr]
        for shown in minted:
            assert not OPENAI_SHAPED.fullmatch(shown), shown  # never a provider's shape
            assert not any(h in shown for h in hexes), shown  # names no conversation
        assert len(set(minted)) == len(minted)
        # Two responses of one conversation, one revision apart, share nothing but the marker.
        one, two = (r.id.removeprefix("resp_ts") for r in responses)
        assert sum(a == b for a, b in zip(one, two, strict=False)) < len(one) // 4
        # The same item is shown by the same id in every listing; an id altered in one
        # character names nothing.
        again = [i.id async for i in client.conversations.items.list(conversation.id)]
        assert again == [i.id for i in items]
        first = responses[0].id
        altered = first[:-1] + ("a" if first[-1] != "a" else "b")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(altered)
        found = await plain.get(f"/v1/conversations/{conversation.id}/items/{items[0].id}")
        assert found.status_code == 200 and found.json()["id"] == items[0].id
        last = items[0].id[-1]
        other = items[0].id[:-1] + ("q" if last != "q" else "r")  # an id one character off
        gone = await plain.get(f"/v1/conversations/{conversation.id}/items/{other}")
        assert gone.status_code == 404


async def test_a_stream_announces_every_item_at_its_place_in_the_output(target: Target) -> None:
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        for fields in ({"conversation": conversation.id}, {}, {"store": False}):
            async with client.responses.stream(
                model="fake-llm", input="hi", include=ENCRYPTED, **fields
            ) as stream:
                events = [event async for event in stream]
                final = await stream.get_final_response()
            kinds = [e.type for e in events]
            assert kinds[:4] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.output_item.done",
            ], fields  # fmt: skip
            added = [(e.output_index, e.item.type, e.item.id) for e in events
                     if e.type == "response.output_item.added"]  # type: ignore[union-attr]  # fmt: skip
            assert added == [(n, o.type, o.id) for n, o in enumerate(final.output)], fields
            assert [o.type for o in final.output] == ["reasoning", "message"]
            deltas = [e for e in events if e.type == "response.output_text.delta"]
            assert {e.output_index for e in deltas} == {1}  # type: ignore[union-attr]
            assert kinds[-1] == "response.completed"
            assert isinstance(final.created_at, float) and final.created_at == int(final.created_at)
            assert final.completed_at is not None and final.completed_at >= final.created_at


async def test_a_stateless_call_leaves_out_another_models_sealed_items(target: Target) -> None:
    """A handoff: model A's answer (its sealed reasoning) in the history of a call for model
    B. B could not open it (the built-in fake refuses it as the API does): it is left out."""
    async with sdk(target, models="*") as (client, _, _plain):
        history: list[Any] = [{"role": "user", "content": "one"}]
        first = await client.responses.create(model="model-a", input=history, store=False)
        history += [*dumped(first.output), {"role": "user", "content": "two"}]
        second = await client.responses.create(model="model-b", input=history, store=False)
        assert second.output_text == "[fake-llm] two (history=2)"
        # A's own model still gets it back (the fake checks the seal).
        history += [*dumped(second.output), {"role": "user", "content": "three"}]
        third = await client.responses.create(model="model-a", input=history, store=False)
        assert third.output_text == "[fake-llm] three (history=4)"
        # A sealed value a client altered is refused, not sent on.
        altered = dict(history[1], encrypted_content=history[1]["encrypted_content"][:-2] + "xx")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="model-a", input=[history[0], altered, *history[2:]], store=False
            )
        assert refused.value.param == "input"


async def test_a_compacting_turns_compaction_item_is_listed_with_its_conversation(
    target: Target,
) -> None:
    compact = [{"type": "compaction", "compact_threshold": 1}]
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        await client.responses.create(conversation=conversation.id, input="one", model="fake-llm")
        second = await client.responses.create(
            conversation=conversation.id, input="two", model="fake-llm",
            extra_body={"context_management": compact},
        )  # fmt: skip
        assert second.output[0].type == "compaction"
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert [getattr(i, "role", None) or i.type for i in items] == [
            "user", "reasoning", "assistant", "user", "compaction", "reasoning", "assistant"
        ]  # fmt: skip
        assert items[4].id == second.output[0].id
        one = await client.conversations.items.retrieve(
            items[4].id, conversation_id=conversation.id
        )
        assert one.type == "compaction"
        # Streamed, the compaction item is announced first, at its place in the output.
        async with client.responses.stream(
            conversation=conversation.id, input="three", model="fake-llm",
            extra_body={"context_management": compact},
        ) as stream:  # fmt: skip
            added = [(e.output_index, e.item.type, e.item.id) async for e in stream
                     if e.type == "response.output_item.added"]  # type: ignore[union-attr]  # fmt: skip
            final = await stream.get_final_response()
        assert [o.type for o in final.output] == ["compaction", "reasoning", "message"]
        assert added == [(n, o.type, o.id) for n, o in enumerate(final.output)]


async def test_an_item_append_during_a_running_turn_says_so(target: Target) -> None:
    gate = asyncio.Event()
    script = Script(gate=gate)
    api = FakeResponsesAPI().then(script)
    async with sdk(target, api.provider()) as (client, _, plain):
        conversation = await client.conversations.create()
        running = asyncio.create_task(
            client.responses.create(conversation=conversation.id, input="slow", model="gpt-test")
        )
        await asyncio.wait_for(script.started.wait(), 10)  # the turn holds its lease
        appended = await plain.post(
            f"/v1/conversations/{conversation.id}/items",
            json={"items": [{"role": "user", "content": "meanwhile"}]},
        )
        gate.set()
        await running
    assert appended.status_code == 409, appended.text
    message = appended.json()["error"]["message"]
    assert "running" in message and "committed first" not in message


async def test_a_long_history_listed_by_turnstore_is_restored_whole(target: Target) -> None:
    """A client sends back a 12-turn conversation's items as listed (reasoning without its
    sealed content, turnstore's ids) to a stateless call: each comes back as stored."""
    async with sdk(target) as (client, _, _plain):
        conversation = await client.conversations.create()
        for n in range(12):
            await client.responses.create(
                conversation=conversation.id, input=f"m{n}", model="fake-llm"
            )
        listed = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        history = [*dumped(listed), {"role": "user", "content": "next"}]
        assert all("encrypted_content" not in item for item in history)
        answer = await client.responses.create(model="fake-llm", input=history, store=False)
    assert answer.output_text == "[fake-llm] next (history=24)"  # the fake checked every seal
