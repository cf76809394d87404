"""A Chat Completions server (vLLM's shape) beside the fake model and Claude in one
conversation, through the official `openai` SDK on /v1 and through /api/v1: the real
ChatProvider against the strict fake Chat server (tests/support/fake_chat.py), which refuses
an assistant message whose thinking or tool calls differ from what it issued, thinking sent
to another model, and a tool message that answers no call."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.chat_completions import ChatEndpoint, ChatProvider
from service.providers.fake import FakeProvider
from service.providers.routing import Routed
from service.providers.wire import WireLimits
from tests.support import fake_anthropic
from tests.support.fake_anthropic import FakeMessagesAPI
from tests.support.fake_chat import API_KEY, BASE_URL, Call, FakeChatServer, Script
from tests.support.helpers import Target, sdk

QWEN, OTHER, FAKE, CLAUDE = "qwen-test", "qwen-other", "fake-llm", "claude-test"
MODELS = f"{FAKE},{QWEN},{OTHER},{CLAUDE}"
TOOLS: Any = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
ENCRYPTED: Any = ["reasoning.encrypted_content"]


def chat_beside_the_others(
    server: FakeChatServer, claude: FakeMessagesAPI | None = None, key: str | None = API_KEY
) -> Routed:
    limits = WireLimits(1.0, 5.0, 262_144)
    chat = ChatProvider(
        ChatEndpoint("vllm", BASE_URL, key, QWEN), limits, transport=server.transport
    )
    served: list[Any] = [
        ("local", FakeProvider(name="local"), [FAKE]),
        ("vllm", chat, [QWEN, OTHER]),
    ]
    if claude is not None:
        anthropic = AnthropicProvider(
            AnthropicEndpoint(
                "claude", "https://anthropic.invalid", fake_anthropic.API_KEY, CLAUDE
            ),
            limits,
            max_tokens=4096,
            transport=httpx.MockTransport(claude.handle),
        )
        served.append(("claude", anthropic, [CLAUDE]))
    return Routed(served, FAKE)


def kept_messages(server: FakeChatServer) -> list[bytes]:
    """The assistant messages the fake issued, as the adapter keeps them (whole replies)."""
    return [issued.raw for issued in server.issued]


async def test_a_vllm_conversation_keeps_its_thinking_and_tool_calls_byte_for_byte(
    target: Target,
) -> None:
    """Ten turns on a /v1 conversation, every third one calling the client's tool (answered by
    the next): each request carries every earlier message verbatim, which the fake checks."""
    server = FakeChatServer()
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create()
        pending: list[Any] = []
        for n in range(1, 11):
            if n % 3 == 0:
                server.then(
                    Script(calls=[Call("weather", {"city": f"C{n}"})], reasoning=f"call {n}")
                )
            else:
                server.then(Script(reasoning=f"Step {n}: ünïcode\nlines", content=f"Answer {n}"))
            answered = await client.responses.create(
                model=QWEN,
                conversation=conversation.id,
                input=pending or f"Question {n}",
                tools=TOOLS,
            )
            calls = [item for item in answered.output if item.type == "function_call"]
            pending = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in calls
            ]
            kinds = [item.type for item in answered.output]
            if n % 3 == 0:
                assert kinds == ["reasoning", "function_call"]
                assert calls[0].call_id.startswith("chatcmpl-tool-")
            else:
                assert kinds == ["reasoning", "message"] and answered.output_text == f"Answer {n}"
                assert answered.output[0].summary[0].text.startswith(f"Step {n}")  # type: ignore[union-attr]
            assert answered.usage is not None and answered.usage.input_tokens > 0
        listed = await client.conversations.items.list(conversation.id, order="asc", limit=100)
    assert not server.refusals and len(server.requests) == 10
    last = server.raw_bodies[-1]
    assert all(message in last for message in kept_messages(server)[:-1])
    assert len({item.id for item in listed.data}) == len(listed.data)  # every part its own id


async def test_switching_among_the_fake_chat_and_claude_every_turn_never_fails(
    target: Target,
) -> None:
    """fake-llm, qwen, Claude, qwen, another qwen model, fake-llm, qwen: each gets the others'
    turns translated (tool pairs with the same ids) and never their thinking."""
    server, claude = FakeChatServer(), FakeMessagesAPI()
    routed = chat_beside_the_others(server, claude)
    async with sdk(target, routed, models=MODELS) as (client, _, plain):
        conversation = await client.conversations.create()
        models = [FAKE, QWEN, CLAUDE, QWEN, OTHER, FAKE, QWEN, CLAUDE]
        pending: list[Any] = []
        for n, model in enumerate(models, start=1):
            if model in (QWEN, OTHER):
                calls = [Call("weather", {"n": n})] if n == 2 else []
                server.then(Script(calls=calls, reasoning=f"qwen thinks {n}"))
            if model == CLAUDE:
                claude.then(
                    fake_anthropic.Script(
                        [fake_anthropic.Thinking(f"claude {n}"), fake_anthropic.Text(f"Claude {n}")]
                    )
                )
            answered = await client.responses.create(
                model=model, conversation=conversation.id, input=pending or f"turn {n}",
                tools=TOOLS, reasoning={"effort": "low"} if model == CLAUDE else None,  # type: ignore[arg-type]
            )  # fmt: skip
            assert answered.model == model
            pending = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in answered.output
                if c.type == "function_call"
            ]
        cid = uuid.UUID(conversation.id.removeprefix("conv_"))
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
    assert [t["model"] for t in turns] == models
    assert not server.refusals and len(claude.requests) == 2
    to_claude = claude.requests[0]["messages"]
    blocks = [b for m in to_claude for b in m["content"]]
    assert "qwen thinks" not in str(blocks)
    assert [b["type"] for b in blocks if b["type"] in ("tool_use", "tool_result")] == [
        "tool_use",
        "tool_result",
    ]
    to_other = server.requests[2]["messages"]  # qwen-other: qwen's messages without thinking
    assert not any(m.get("reasoning_content") for m in to_other)
    assert "claude 3" not in str(to_other) and "Claude 3" in str(to_other)
    last_qwen = server.raw_bodies[3]
    assert "qwen thinks 5" not in last_qwen.decode()  # qwen-other's thinking stays with it
    assert (
        server.issued[0].raw in last_qwen and server.issued[1].raw in last_qwen
    )  # its own, verbatim


async def test_a_stateless_client_gets_the_chat_message_back_from_the_sealed_value(
    target: Target,
) -> None:
    """store: false with encrypted reasoning included, the output sent back each time: the
    message comes back byte for byte (and its text and calls are not sent twice); one altered
    character of a sealed value is 400 and never reaches the server."""
    server = FakeChatServer()
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (client, _, _plain):
        history: list[Any] = [{"role": "user", "content": "Hello"}]
        for n in range(1, 4):
            server.then(Script(calls=[Call("weather")] if n == 2 else [], reasoning=f"why {n}"))
            answered = await client.responses.create(
                model=QWEN, input=history, store=False, include=ENCRYPTED, tools=TOOLS
            )
            output = [item.model_dump(exclude_none=True) for item in answered.output]
            assert output[0]["type"] == "reasoning" and output[0]["encrypted_content"].startswith(
                "ts"
            )
            history += output
            calls = [o for o in output if o["type"] == "function_call"]
            history += [
                {"type": "function_call_output", "call_id": c["call_id"], "output": "ok"}
                for c in calls
            ]
            history += [] if calls else [{"role": "user", "content": f"And {n}?"}]
        assert not server.refusals and len(server.requests) == 3
        sent = server.raw_bodies[-1]
        assert server.issued[0].raw in sent and server.issued[1].raw in sent
        roles = [m["role"] for m in server.requests[-1]["messages"]]
        assert roles == ["user", "assistant", "user", "assistant", "tool"]

        forged = [dict(item) for item in history]
        sealed = forged[1]["encrypted_content"]
        middle = len(sealed) // 2
        forged[1]["encrypted_content"] = (
            sealed[:middle] + ("A" if sealed[middle] != "A" else "B") + sealed[middle + 1 :]
        )
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=QWEN, input=forged, store=False)
        assert refused.value.param == "input"
        assert len(server.requests) == 3
        # Sent to another model, the sealed message stays out; its text and call go translated.
        server.then(Script())
        await client.responses.create(model=OTHER, input=history, store=False, tools=TOOLS)
        assert not server.refusals
        assert "why 1" not in server.raw_bodies[-1].decode()


async def test_items_listed_from_a_stored_response_come_back_whole(target: Target) -> None:
    """A client that keeps the ids turnstore showed sends the listed items back: each part is
    restored from the stored message, the message itself verbatim, once."""
    server = FakeChatServer().then(Script(calls=[Call("weather")], content="Let me see."))
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (client, _, _plain):
        first = await client.responses.create(model=QWEN, input="Weather?", tools=TOOLS)
        assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
        items: list[Any] = [{"role": "user", "content": "Weather?"}]
        items += [{"type": "item_reference", "id": i.id} for i in first.output]
        call = first.output[2]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})  # type: ignore[union-attr]
        await client.responses.create(model=QWEN, input=items, store=False, tools=TOOLS)
    assert not server.refusals
    assert server.issued[0].raw in server.raw_bodies[-1]
    assert [m["role"] for m in server.requests[-1]["messages"]] == ["user", "assistant", "tool"]


@pytest.mark.parametrize("stored", [True, False])
async def test_a_streamed_chat_turn_is_openais_events_and_its_final_response(
    target: Target, stored: bool
) -> None:
    server = FakeChatServer()
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create() if stored else None
        history: list[Any] = [{"role": "user", "content": "Hello"}]
        for n in (1, 2):
            server.then(Script(reasoning=f"thinking {n}", content=f"Answer {n}"))
            where: dict[str, Any] = {"conversation": conversation.id} if conversation else {}
            stream = await client.responses.create(
                model=QWEN, input=history if not stored else f"Hello {n}", store=stored,
                include=ENCRYPTED, stream=True, **where,
            )  # fmt: skip
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
            assert added == shown, (added, shown)
            assert [kind for _, kind, _ in shown] == ["reasoning", "message"]
            output = [item.model_dump(exclude_none=True) for item in final.output]
            history += [*output, {"role": "user", "content": f"And {n}?"}]
        if stored:
            listed = await client.conversations.items.list(conversation.id, order="asc")  # type: ignore[union-attr]
            assert [i.id for i in listed.data[-2:]] == [i for _, _, i in shown]
    assert not server.refusals and len(server.requests) == 2
    replayed = server.requests[1]["messages"]
    assert [m.get("reasoning_content") for m in replayed if m["role"] == "assistant"] == [
        "thinking 1"
    ]


async def test_a_chat_failure_commits_nothing_and_is_the_contracts_error(target: Target) -> None:
    server = FakeChatServer()
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (_client, _, plain):
        first = await plain.post("/api/v1/chat", json={"message": "hi", "model": QWEN})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        cases = [
            (Script(http_status=429), 429, "rate_limited"),
            (Script(http_status=500), 502, "upstream_error"),
            (Script(http_status=400, message="This model's maximum context length is 9 tokens."), 400, "context_length_exceeded"),
            (Script(exception=httpx.ReadTimeout("slow")), 504, "upstream_timeout"),
            (Script(finish_reason="content_filter"), 422, "content_filtered"),
            (Script(stream_error=True), 502, "upstream_error"),
        ]  # fmt: skip
        for script, status, code in cases:
            server.then(script)
            stream = script.stream_error
            path = "/api/v1/chat/stream" if stream else "/api/v1/chat"
            failed = await plain.post(
                path, json={"message": "again", "conversation_id": cid, "model": QWEN}
            )
            if stream:
                assert '"upstream_error"' in failed.text and API_KEY not in failed.text
                continue
            assert failed.status_code == status, failed.text
            assert failed.json()["error"]["code"] == code
            if status == 429:
                assert failed.headers["retry-after"] == "7"
            assert API_KEY not in failed.text
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
        assert len(turns) == 1  # nothing of the failed turns was kept
        assert API_KEY not in (await plain.get("/metrics")).text
    assert all(h["authorization"] == f"Bearer {API_KEY}" for h in server.headers)


async def test_a_keyless_server_gets_no_authorization(target: Target) -> None:
    server = FakeChatServer(api_key=None)
    async with sdk(target, chat_beside_the_others(server, key=None), models=MODELS) as (
        client,
        _,
        _plain,
    ):
        answered = await client.responses.create(model=QWEN, input="hi")
        assert answered.output_text == "reply 1"
    assert "authorization" not in server.headers[0]


async def test_chat_cannot_count_tokens_nor_compact_and_says_so(target: Target) -> None:
    server = FakeChatServer()
    async with sdk(target, chat_beside_the_others(server), models=MODELS) as (client, _, _plain):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.input_tokens.count(model=QWEN, input="hello there")
        assert "cannot count tokens" in refused.value.message
        with pytest.raises(openai.BadRequestError) as compacting:
            await client.responses.create(
                model=QWEN, input="hi",
                context_management=[{"type": "compaction", "compact_threshold": 1}],  # type: ignore[list-item]
            )  # fmt: skip
        assert compacting.value.param == "context_management"
        with pytest.raises(openai.BadRequestError) as field:
            await client.responses.create(model=QWEN, input="hi", top_logprobs=2)
        assert field.value.param == "top_logprobs"
    assert not server.requests  # none of it reached the server


async def test_a_streamed_chat_turn_with_turnstores_own_tool_names_its_message_as_listed(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "lookup.json"
    data.write_text('{"k1": "v1"}')
    monkeypatch.setenv("LOOKUP_DATA_FILE", str(data))
    server = FakeChatServer().then(
        Script(calls=[Call("lookup", {"key": "k1"})], reasoning="look it up"),
        Script(reasoning="got it", content="The value is v1"),
    )
    tools = "service.tools.lookup:lookup"
    async with sdk(target, chat_beside_the_others(server), models=MODELS, tools=tools) as (
        client,
        _,
        _plain,
    ):
        conversation = await client.conversations.create()
        stream = await client.responses.create(
            model=QWEN, conversation=conversation.id, input="what is k1?", stream=True
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
    assert not server.refusals
    assert [m["role"] for m in server.requests[1]["messages"]] == ["user", "assistant", "tool"]
