"""Claude beside another model in one conversation, through the official `openai` SDK on /v1
and through /api/v1: the real AnthropicProvider against the strict fake Anthropic API
(tests/support/fake_anthropic.py), which refuses any replayed thinking block that differs from
what it issued by a byte, was merged or emptied, or goes to another model."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.core.model import key_id
from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.fake import FakeProvider
from service.providers.routing import Routed
from service.providers.wire import WireLimits
from tests.support import fake_anthropic
from tests.support.fake_anthropic import API_KEY, FakeMessagesAPI, Redacted, Script, Text, Thinking
from tests.support.fake_anthropic import ToolUse as Call
from tests.support.helpers import Target, retries, sdk

CLAUDE, FAKE, OTHER = "claude-test", "fake-llm", "claude-other"
MODELS = f"{FAKE},{CLAUDE}"
THINK = {"effort": "low"}


def claude_beside_the_fake(api: FakeMessagesAPI) -> Routed:
    claude = AnthropicProvider(
        AnthropicEndpoint("claude", "https://anthropic.invalid", API_KEY, CLAUDE),
        WireLimits(1.0, 5.0, 262_144),
        max_tokens=4096,
        transport=httpx.MockTransport(api.handle),
    )
    return Routed(
        [("local", FakeProvider(name="local"), [FAKE]), ("claude", claude, [CLAUDE])], FAKE
    )


def thinking_reply(n: int) -> Script:
    """Several thinking blocks, one of them empty but signed, redacted thinking, then text."""
    return Script(
        [Thinking(f"Step {n}: ünïcode\nand lines"), Thinking(""), Redacted(), Text(f"Answer {n}")]
    )


async def test_twenty_claude_turns_with_thinking_and_tools_replay_every_block_byte_for_byte(
    target: Target,
) -> None:
    """Every 4th turn Claude calls the client's tool and the next turn answers it; the fake
    refuses a request whose earlier thinking differs from what it issued, so 20 accepted
    turns mean every block went back byte for byte, in order, never merged or emptied."""
    api = FakeMessagesAPI(min_cache_tokens=64)
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create()
        pending: list[Any] = []
        for n in range(1, 21):
            if n % 4 == 0:
                api.then(Script([Thinking(f"Call {n}"), Call("weather", {"city": f"C{n}"})]))
            else:
                api.then(thinking_reply(n))
            answered = await client.responses.create(
                model=CLAUDE,
                conversation=conversation.id,
                input=pending or f"Question {n}",
                reasoning=THINK,
                tools=tools,  # type: ignore[arg-type]
            )
            calls = [item for item in answered.output if item.type == "function_call"]
            pending = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in calls
            ]
            if n % 4 == 0:
                assert calls and calls[0].name == "weather"
            else:
                assert answered.output_text == f"Answer {n}"
                kinds = [item.type for item in answered.output]
                assert kinds == ["reasoning", "reasoning", "reasoning", "message"]
                assert answered.output[0].summary[0].text.startswith(f"Step {n}")
    assert len(api.requests) == 20
    last = api.requests[-1]["messages"]
    thinking = [b for m in last for b in m["content"] if b["type"] == "thinking"]
    redacted = [b for m in last for b in m["content"] if b["type"] == "redacted_thinking"]
    assert len(thinking) == 15 * 2 + 4 and len(redacted) == 15  # none dropped, none merged


async def test_switching_models_every_turn_never_costs_a_failed_call(target: Target) -> None:
    """fake-llm, Claude, fake-llm, Claude on one conversation: each provider gets the other's
    turns translated (its own verbatim) and never the other's thinking or sealed reasoning."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (_client, _, plain):
        cid = None
        for n, model in enumerate([FAKE, CLAUDE, FAKE, CLAUDE, CLAUDE, FAKE], start=1):
            if model == CLAUDE:
                api.then(thinking_reply(n))
            body: dict[str, Any] = {"message": f"turn {n}", "model": model}
            if cid:
                body["conversation_id"] = cid
            answered = await plain.post("/api/v1/chat", json=body)
            assert answered.status_code == 200, answered.text
            cid = answered.json()["conversation_id"]
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
    assert [t["model"] for t in turns] == [FAKE, CLAUDE, FAKE, CLAUDE, CLAUDE, FAKE]
    stored = await target.stored(uuid.UUID(cid))
    assert stored is not None
    origins = [turn.origin for turn in stored.turns]
    local, claude = ("local", "fake"), ("claude", "anthropic")
    made_by = [local, claude, local, claude, claude, local]
    assert [(o.provider, o.kind) for o in origins if o] == made_by
    fingerprints = {o.key_fingerprint for o in origins if o and o.kind == "anthropic"}
    assert fingerprints == {key_id(API_KEY)}  # the key's name, never the key
    assert len(api.requests) == 3
    sent = api.requests[1]["messages"]  # Claude's second turn: the fake's turns translated
    assert all(b.get("type") != "reasoning" for m in sent for b in m["content"])
    assert [m["role"] for m in sent] == ["user", "assistant"] * 3 + ["user"]
    assert [b["text"] for b in sent[1]["content"]] == ["[fake-llm] turn 1"]


async def test_a_stateless_client_gets_claudes_blocks_back_from_the_sealed_value(
    target: Target,
) -> None:
    """store: false with encrypted reasoning included, three calls, each sending back the
    previous output: Claude's thinking comes back byte for byte (the fake accepts it); one
    altered character of a sealed value is 400 and never reaches Claude."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, _plain):
        history: list[Any] = [{"role": "user", "content": "Hello"}]
        for n in range(1, 4):
            api.then(thinking_reply(n))
            answered = await client.responses.create(
                model=CLAUDE,
                input=history,
                store=False,
                reasoning=THINK,
                include=["reasoning.encrypted_content"],
            )
            assert answered.output_text == f"Answer {n}"
            output = [item.model_dump(exclude_none=True) for item in answered.output]
            assert all(o["encrypted_content"].startswith("ts") for o in output[:3])
            history += [*output, {"role": "user", "content": f"And {n}?"}]
        assert len(api.requests) == 3
        assert (
            sum(b["type"] == "thinking" for m in api.requests[-1]["messages"] for b in m["content"])
            == 4
        )

        forged = json.loads(json.dumps(history))
        sealed = forged[1]["encrypted_content"]
        middle = len(sealed) // 2  # a character that carries ciphertext (not base64 padding)
        altered = "A" if sealed[middle] != "A" else "B"
        forged[1]["encrypted_content"] = sealed[:middle] + altered + sealed[middle + 1 :]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=CLAUDE, input=forged, store=False)
        assert refused.value.param == "input"
        assert len(api.requests) == 3  # refused before Claude was called


async def test_a_claude_failure_commits_nothing_and_is_the_contracts_error(target: Target) -> None:
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (_client, _, plain):
        first = await plain.post("/api/v1/chat", json={"message": "hi", "model": CLAUDE})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        for status, code in [(529, "rate_limited"), (429, "rate_limited"), (500, "upstream_error")]:
            api.then(Script(http_status=status, retry_after="7"))
            failed = await plain.post(
                "/api/v1/chat", json={"message": "again", "conversation_id": cid, "model": CLAUDE}
            )
            assert failed.status_code == {529: 429, 429: 429, 500: 502}[status], failed.text
            assert failed.json()["error"]["code"] == code
            assert API_KEY not in failed.text
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
        assert len(turns) == 1  # nothing of the failed turns was kept
        metrics = (await plain.get("/metrics")).text
        assert API_KEY not in metrics


@pytest.mark.parametrize("stored", [True, False])
async def test_a_streamed_claude_turn_is_openais_events_and_its_final_response(
    target: Target, stored: bool
) -> None:
    """Streamed with OpenAI's events: each item announced at its place (thinking as reasoning,
    then the message its deltas fill), and the final Response holds the same items; the
    next turn replays them (stored: from the conversation; stateless: sent back)."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create() if stored else None
        history: list[Any] = [{"role": "user", "content": "Hello"}]
        for n in (1, 2):
            api.then(thinking_reply(n))
            where: dict[str, Any] = {"conversation": conversation.id} if conversation else {}
            stream = await client.responses.create(
                model=CLAUDE,
                input=history if not stored else f"Hello {n}",
                store=stored,
                reasoning=THINK,
                include=["reasoning.encrypted_content"],
                stream=True,
                **where,
            )
            added, deltas, final = [], [], None
            async for event in stream:
                if event.type == "response.output_item.added":
                    added.append((event.output_index, event.item.type, event.item.id))
                elif event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                elif event.type == "response.completed":
                    final = event.response
            assert final is not None and final.output_text == f"Answer {n}" == "".join(deltas)
            shown = [(index, item.type, item.id) for index, item in enumerate(final.output)]
            assert added == shown, (added, shown)  # announced at its place, under its final id
            assert [kind for _, kind, _ in shown] == ["reasoning"] * 3 + ["message"]
            output = [item.model_dump(exclude_none=True) for item in final.output]
            history += [*output, {"role": "user", "content": f"And {n}?"}]
    assert len(api.requests) == 2
    replayed = api.requests[1]["messages"]
    assert sum(b["type"] == "thinking" for m in replayed for b in m["content"]) == 2


async def test_a_refused_signature_is_retried_once_without_earlier_thinking_and_counted(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After Anthropic stops accepting the signatures it issued (as after an organisation
    change), the next turn is sent once more without earlier thinking: it commits, and
    /metrics counts the retry."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, plain):
        conversation = await client.conversations.create()
        before = retries((await plain.get("/metrics")).text, CLAUDE)
        for n in (1, 2):
            if n == 2:
                monkeypatch.setattr(fake_anthropic, "SECRET", b"another organisation's key")
            api.then(thinking_reply(n))
            answered = await client.responses.create(
                model=CLAUDE, conversation=conversation.id, input=f"Q{n}", reasoning=THINK
            )
            assert answered.output_text == f"Answer {n}"
        metrics = (await plain.get("/metrics")).text
    assert len(api.requests) == 3  # turn 2 refused once, then sent without earlier thinking
    retried = api.requests[2]["messages"]
    assert all(
        b["type"] not in ("thinking", "redacted_thinking") for m in retried for b in m["content"]
    )
    assert retries(metrics, CLAUDE) == before + 1


async def test_claude_counts_input_tokens_and_refuses_compaction_a_client_asks_for(
    target: Target,
) -> None:
    """input_tokens is Anthropic's count_tokens; context_management on Claude (which does not
    compact) is 400 naming it, before any call."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, _plain):
        counted = await client.responses.input_tokens.count(model=CLAUDE, input="hello there")
        assert counted.input_tokens > 0 and api.urls[-1].endswith("/v1/messages/count_tokens")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=CLAUDE,
                input="hi",
                context_management=[{"type": "compaction", "compact_threshold": 1}],  # type: ignore[list-item]
            )
        assert refused.value.param == "context_management"
    assert all(url.endswith("/count_tokens") for url in api.urls)  # no turn reached Claude


async def test_with_context_strategy_compact_a_claude_turn_keeps_the_whole_turn_window(
    target: Target,
) -> None:
    """CONTEXT_STRATEGY=compact past its threshold: Claude does not compact, so its turns run
    on the whole-turn window, as with drop, and commit."""
    api = FakeMessagesAPI()
    settings = {"context_strategy": "compact", "compact_threshold_tokens": 1}
    async with sdk(target, claude_beside_the_fake(api), models=MODELS, **settings) as (
        _client,
        _,
        plain,
    ):
        cid = None
        for n in range(1, 4):
            api.then(thinking_reply(n))
            body: dict[str, Any] = {"message": f"turn {n}", "model": CLAUDE}
            if cid:
                body["conversation_id"] = cid
            answered = await plain.post("/api/v1/chat", json=body)
            assert answered.status_code == 200, answered.text
            cid = answered.json()["conversation_id"]
    assert [len(r["messages"]) for r in api.requests] == [1, 3, 5]


async def test_switching_models_on_v1_with_reasoning_on_both_never_fails(target: Target) -> None:
    """The same over /v1 with reasoning asked of both: the fake's sealed reasoning never goes
    to Claude, Claude's signed thinking never to the fake, and each gets its own back."""
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create()
        models = [FAKE, CLAUDE, FAKE, CLAUDE, CLAUDE, FAKE, CLAUDE]
        for n, model in enumerate(models, start=1):
            if model == CLAUDE:
                api.then(thinking_reply(n))
            answered = await client.responses.create(
                model=model, conversation=conversation.id, input=f"turn {n}", reasoning=THINK
            )
            assert answered.model == model and answered.output_text
    last = api.requests[-1]["messages"]
    thinking = [b for m in last for b in m["content"] if b["type"] == "thinking"]
    assert len(thinking) == 3 * 2  # Claude's own three turns' thinking, none of the fake's
    assert all(b["type"] != "reasoning" for m in last for b in m["content"])


async def test_a_stateless_claude_reply_appended_to_a_conversation_keeps_its_origin(
    target: Target,
) -> None:
    """Items of a store:false Claude reply appended to a conversation keep the model that made
    them: its thinking goes back to that model only, so the next turn on another Claude model
    costs no refused call (the turn once had no origin, and its thinking went anywhere)."""
    api = FakeMessagesAPI()
    claude = AnthropicProvider(
        AnthropicEndpoint("claude", "https://anthropic.invalid", API_KEY, CLAUDE),
        WireLimits(1.0, 5.0, 262_144),
        max_tokens=4096,
        transport=httpx.MockTransport(api.handle),
    )
    both = Routed([("claude", claude, [CLAUDE, OTHER])], CLAUDE)
    async with sdk(target, both, models=f"{CLAUDE},{OTHER}") as (client, _, _plain):
        api.then(thinking_reply(1))
        first = await client.responses.create(
            model=CLAUDE,
            input="hi",
            store=False,
            reasoning=THINK,
            include=["reasoning.encrypted_content"],
        )
        output = [item.model_dump(exclude_none=True) for item in first.output]
        conversation = await client.conversations.create(
            items=[{"role": "user", "content": "hi"}, *output]
        )
        appended = await target.stored(uuid.UUID(conversation.id.removeprefix("conv_")))
        assert appended is not None and appended.turns[-1].origin is not None
        sealed_by = appended.turns[-1].origin  # from the sealed value: all of the origin
        assert (sealed_by.model, sealed_by.kind) == (CLAUDE, "anthropic")
        assert sealed_by.key_fingerprint == key_id(API_KEY)
        api.then(thinking_reply(2))
        await client.responses.create(
            model=OTHER, conversation=conversation.id, input="now you", reasoning=THINK
        )
        api.then(thinking_reply(3))
        await client.responses.create(
            model=CLAUDE, conversation=conversation.id, input="and you", reasoning=THINK
        )
    assert len(api.requests) == 3  # no refused call, no retry
    to_other, back = api.requests[1]["messages"], api.requests[2]["messages"]
    assert all(b["type"] == "text" for m in to_other for b in m["content"])
    assert sum(b["type"] == "thinking" for m in back for b in m["content"]) == 2  # its own


async def test_a_streamed_claude_turn_with_turnstores_own_tool_names_its_message_as_listed(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn whose first round runs turnstore's own tool: the streamed message's id is the one
    the Response and the conversation's items list it by (its place counts the tool round)."""
    data = tmp_path / "lookup.json"
    data.write_text('{"k1": "v1"}')
    monkeypatch.setenv("LOOKUP_DATA_FILE", str(data))
    api = FakeMessagesAPI()
    tools = "service.tools.lookup:lookup"
    async with sdk(target, claude_beside_the_fake(api), models=MODELS, tools=tools) as (
        client,
        _,
        _plain,
    ):
        conversation = await client.conversations.create()
        api.then(
            Script([Thinking("look it up"), Call("lookup", {"key": "k1"})]),
            Script([Thinking("got it"), Text("The value is v1")]),
        )
        stream = await client.responses.create(
            model=CLAUDE,
            conversation=conversation.id,
            input="what is k1?",
            reasoning=THINK,
            stream=True,
        )
        added, final = [], None
        async for event in stream:
            if event.type == "response.output_item.added":
                added.append((event.output_index, event.item.type, event.item.id))
            elif event.type == "response.completed":
                final = event.response
        assert final is not None and final.output_text == "The value is v1"
        shown = [(index, item.type, item.id) for index, item in enumerate(final.output)]
        assert added == shown
        listed = await client.conversations.items.list(conversation.id, order="asc")
        assert shown[-1][2] == listed.data[-1].id


async def test_removing_claudes_answer_removes_it_from_the_transcript(target: Target) -> None:
    api = FakeMessagesAPI()
    async with sdk(target, claude_beside_the_fake(api), models=MODELS) as (client, _, plain):
        conversation = await client.conversations.create()
        api.then(thinking_reply(1))
        await client.responses.create(
            model=CLAUDE, conversation=conversation.id, input="hi", reasoning=THINK
        )
        last = (await client.conversations.items.list(conversation.id, order="desc")).data[0]
        assert last.type == "message"
        removed = await plain.delete(f"/v1/conversations/{conversation.id}/items/{last.id}")
        assert removed.status_code == 200, removed.text
        cid = uuid.UUID(conversation.id.removeprefix("conv_"))
        messages = (await plain.get(f"/api/v1/conversations/{cid}")).json()["messages"]
        said = [(m["role"], m["content"]) for m in messages]
    assert said == [("user", "hi")]
