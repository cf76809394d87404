"""Gemini beside other models in one conversation, through the official `openai` SDK on /v1 and
through /api/v1: the real GeminiProvider against the strict fake Gemini API
(tests/support/fake_gemini.py), which refuses a part whose signature was altered, moved to
another part or replayed to another model, and a Gemini 3 function call replayed without its
signature."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from service.providers.anthropic import AnthropicEndpoint, AnthropicProvider
from service.providers.fake import FakeProvider
from service.providers.gemini import GeminiEndpoint, GeminiProvider
from service.providers.routing import Routed
from service.providers.wire import WireLimits
from tests.support import fake_anthropic, fake_gemini
from tests.support.fake_anthropic import FakeMessagesAPI
from tests.support.fake_gemini import API_KEY, Call, FakeGeminiAPI, Script, Text, Thought
from tests.support.helpers import Target, retries, sdk

GEMINI, OTHER, OLDER = "gemini-3-test", "gemini-3-other", "gemini-2.5-test"
FAKE, CLAUDE = "fake-llm", "claude-test"
MODELS = f"{FAKE},{GEMINI},{OTHER},{OLDER},{CLAUDE}"
THINK = {"effort": "low", "summary": "auto"}  # readable thinking: Gemini's thought parts
TOOLS: Any = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]


def gemini(api: FakeGeminiAPI) -> GeminiProvider:
    return GeminiProvider(
        GeminiEndpoint("google", "https://gemini.invalid", API_KEY, GEMINI),
        WireLimits(1.0, 5.0, 262_144),
        transport=httpx.MockTransport(api.handle),
    )


def everyone(api: FakeGeminiAPI, claude_api: FakeMessagesAPI | None = None) -> Routed:
    """The built-in fake, Gemini (three models) and Claude, routed by model."""
    claude = AnthropicProvider(
        AnthropicEndpoint("claude", "https://anthropic.invalid", fake_anthropic.API_KEY, CLAUDE),
        WireLimits(1.0, 5.0, 262_144),
        max_tokens=4096,
        transport=httpx.MockTransport((claude_api or FakeMessagesAPI()).handle),
    )
    return Routed(
        [
            ("local", FakeProvider(name="local"), [FAKE]),
            ("google", gemini(api), [GEMINI, OTHER, OLDER]),
            ("claude", claude, [CLAUDE]),
        ],
        FAKE,
    )


def answer(n: int) -> Script:
    """Two thought parts (each signed), then text (signed, as Gemini 3 ends a reply)."""
    return Script(
        [Thought(f"Step {n}: ünïcode\nand lines"), Thought("Then this."), Text(f"Answer {n}")]
    )


def calls(n: int) -> Script:
    """A thought, then two calls at once: only the first carries the signature."""
    return Script(
        [
            Thought(f"Call {n}"),
            Call("weather", {"city": f"C{n}"}),
            Call("weather", {"city": "Oslo"}),
        ]
    )


def replayed(api: FakeGeminiAPI, request: int = -1) -> list[dict[str, Any]]:
    """The model parts a request sent, in order."""
    contents = api.requests[request]["contents"]
    return [p for c in contents if c["role"] == "model" for p in c["parts"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_ten_gemini_3_turns_with_tools_replay_every_part_with_its_signature(
    target: Target, stream: bool
) -> None:
    """Every 3rd turn Gemini calls the client's tool twice at once and the next turn answers;
    the fake refuses a call without its signature and a signature moved, altered or sent to
    another model, so ten accepted turns, and every part issued found in the last request as
    issued, mean each part went back with its signature on it."""
    api = FakeGeminiAPI(min_cache_tokens=64)
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create()
        pending: list[Any] = []
        for n in range(1, 11):
            api.then(calls(n) if n % 3 == 0 else answer(n))
            created = await client.responses.create(
                model=GEMINI,
                conversation=conversation.id,
                input=pending or f"Question {n}",
                reasoning=THINK,  # type: ignore[arg-type]
                tools=TOOLS,
                stream=stream,
            )
            if stream:
                final = None
                async for event in created:  # type: ignore[union-attr]
                    if event.type == "response.completed":
                        final = event.response
                assert final is not None
                answered = final
            else:
                answered = created  # type: ignore[assignment]
            made = [item for item in answered.output if item.type == "function_call"]
            pending = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in made
            ]
            if n % 3 == 0:
                assert [c.name for c in made] == ["weather", "weather"]
                assert len({c.call_id for c in made}) == 2
            else:
                assert answered.output_text == f"Answer {n}"
                kinds = [item.type for item in answered.output]
                assert kinds == ["reasoning", "reasoning", "message"]
                assert answered.output[0].summary[0].text.startswith(f"Step {n}")
    assert api.refusals == [] and len(api.requests) == 10, (api.refusals, api.urls)
    sent = replayed(api)
    issued = api.issued[: -len(answer(10).parts or [])]  # all but the last reply's
    assert sent == issued  # every part, in order, its signature on it
    signed = [p for p in sent if "thoughtSignature" in p]
    assert len(signed) == 6 * 3 + 3 * 2  # thoughts and texts, the first call of each step


async def test_a_call_ids_given_by_gemini_are_its_call_ids_everywhere(target: Target) -> None:
    api = FakeGeminiAPI(call_ids=True)
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        api.then(calls(1), answer(2))
        first = await client.responses.create(model=GEMINI, input="weather?", tools=TOOLS)
        ids = [item.call_id for item in first.output if item.type == "function_call"]
        given = [p["functionCall"]["id"] for p in api.issued if "functionCall" in p]
        assert ids == given
        outputs: Any = [{"type": "function_call_output", "call_id": i, "output": "x"} for i in ids]
        await client.responses.create(
            model=GEMINI, input=outputs, previous_response_id=first.id, tools=TOOLS
        )
    answers = [p["functionResponse"] for c in api.requests[1]["contents"] for p in c["parts"]
               if "functionResponse" in p]  # fmt: skip
    assert [a["id"] for a in answers] == given


async def test_switching_fake_gemini_claude_gemini_never_costs_a_failed_call(
    target: Target,
) -> None:
    """fake-llm, Gemini 3 (with tool calls), Claude, another Gemini 3 model, Gemini 2.5 and
    back: each gets the others' turns translated with the same call ids, its own verbatim,
    and never another's thinking or signatures (a Gemini call it never issued carries the
    documented placeholder)."""
    api, claude_api = FakeGeminiAPI(), FakeMessagesAPI()
    claude_api.then(*[fake_anthropic.Script() for _ in range(3)])
    async with sdk(target, everyone(api, claude_api), models=MODELS) as (client, _, _plain):
        conversation = await client.conversations.create()
        pending: list[Any] = []
        models = [FAKE, GEMINI, GEMINI, CLAUDE, OTHER, OLDER, GEMINI, FAKE, CLAUDE, GEMINI]
        for n, model in enumerate(models, start=1):
            if model in (GEMINI, OTHER, OLDER):
                api.then(calls(n) if n == 2 else answer(n))
            answered = await client.responses.create(
                model=model,
                conversation=conversation.id,
                input=pending or f"turn {n}",
                reasoning={"effort": "low"},
                tools=TOOLS,
            )
            assert answered.model == model
            made = [item for item in answered.output if item.type == "function_call"]
            pending = [
                {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in made
            ]
    assert len(api.requests) == 6 and len(claude_api.requests) == 2
    # Claude got Gemini's calls as tool_use blocks of the same ids, and no signature.
    to_claude = claude_api.requests[0]["messages"]
    uses = [b for m in to_claude for b in m["content"] if b["type"] == "tool_use"]
    results = [b for m in to_claude for b in m["content"] if b["type"] == "tool_result"]
    assert len(uses) == 2 and [r["tool_use_id"] for r in results] == [u["id"] for u in uses]
    assert "thoughtSignature" not in json.dumps(claude_api.requests)
    # Another Gemini 3 model: the calls translated, with the placeholder; no thought of GEMINI's.
    to_other = replayed(api, 2)
    assert all(not p.get("thought") for p in to_other)
    placeheld = [p for p in to_other if "functionCall" in p]
    assert [p["thoughtSignature"] for p in placeheld] == [fake_gemini.PLACEHOLDERS[0]] * 2
    assert [p["functionCall"]["id"] for p in placeheld] == [u["id"] for u in uses]
    # Back on GEMINI: its own turns verbatim (signatures and thoughts), the others' translated.
    back = replayed(api, 4)
    assert [p for p in back if p in api.issued][:3] == api.issued[:3]  # turns 2 and 3's


async def test_a_stateless_client_gets_geminis_parts_back_from_the_sealed_values(
    target: Target,
) -> None:
    """store: false with encrypted reasoning included: thought parts as reasoning items whose
    encrypted_content is the sealed part, a signed call as its function_call and a reasoning
    item carrying it (each call does: its exact form is Gemini's); sent back, the original parts reach Gemini byte for byte (the fake
    refuses a call without its signature); one altered character is 400, before Gemini."""
    api = FakeGeminiAPI()
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        history: list[Any] = [{"role": "user", "content": "Weather?"}]
        for n in range(1, 4):
            api.then(calls(n) if n == 1 else answer(n))
            answered = await client.responses.create(
                model=GEMINI,
                input=history,
                store=False,
                reasoning=THINK,  # type: ignore[arg-type]
                tools=TOOLS,
                include=["reasoning.encrypted_content"],
            )
            output = [item.model_dump(exclude_none=True) for item in answered.output]
            reasoning = [o for o in output if o["type"] == "reasoning"]
            assert reasoning and all(o["encrypted_content"].startswith("ts") for o in reasoning)
            made = [o for o in output if o["type"] == "function_call"]
            outputs = [
                {"type": "function_call_output", "call_id": c["call_id"], "output": "sun"}
                for c in made
            ]
            history += [*output, *(outputs or [{"role": "user", "content": f"And {n}?"}])]
            if n == 1:
                assert [o["type"] for o in output] == [
                    "reasoning", "function_call", "reasoning", "function_call", "reasoning",
                ]  # fmt: skip
        assert len(api.requests) == 3
        assert replayed(api)[: len(replayed(api, 1))] == replayed(api, 1)
        assert replayed(api, 1) == api.issued[:3], (replayed(api, 1), api.issued[:3])

        forged = json.loads(json.dumps(history))
        sealed = forged[1]["encrypted_content"]
        middle = len(sealed) // 2
        altered = "A" if sealed[middle] != "A" else "B"
        forged[1]["encrypted_content"] = sealed[:middle] + altered + sealed[middle + 1 :]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=GEMINI, input=forged, store=False, tools=TOOLS)
        assert refused.value.param == "input"
        assert len(api.requests) == 3

        # The same history to Claude: Gemini's parts translated, its signatures left out.
        to_claude: list[Any] = [*history]
        answered = await client.responses.create(model=CLAUDE, input=to_claude, store=False)
        assert answered.output_text


@pytest.mark.parametrize(
    ("script", "status", "code"),
    [
        (Script(http_status=429), 429, "rate_limited"),
        (Script(http_status=429, retry_after="11"), 429, "rate_limited"),
        (Script(http_status=503), 502, "upstream_error"),
        (Script(http_status=500), 502, "upstream_error"),
        (Script(http_status=504), 504, "upstream_timeout"),
        (Script(finish_reason="SAFETY"), 422, "content_filtered"),
        (Script(finish_reason="RECITATION"), 422, "content_filtered"),
        (Script(block_reason="PROHIBITED_CONTENT"), 422, "content_filtered"),
        (Script(finish_reason="MALFORMED_FUNCTION_CALL"), 502, "upstream_error"),
        (Script(http_status=200, exception=httpx.ReadTimeout("slow")), 504, "upstream_timeout"),
        (Script(stream_error=True), 502, "upstream_error"),
        (Script(raw_body=b"{not json"), 502, "upstream_error"),
    ],
)
async def test_a_gemini_failure_commits_nothing_and_is_the_contracts_error(
    target: Target, script: Script, status: int, code: str
) -> None:
    api = FakeGeminiAPI()
    async with sdk(target, everyone(api), models=MODELS) as (_client, _, plain):
        api.then(answer(1))
        first = await plain.post("/api/v1/chat", json={"message": "hi", "model": GEMINI})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        api.then(script)
        body = {"message": "again", "conversation_id": cid, "model": GEMINI}
        failed = await plain.post(
            "/api/v1/chat/stream" if script.stream_error else "/api/v1/chat", json=body
        )
        if script.stream_error:
            assert '"code":"upstream_error"' in failed.text.replace(" ", "")
        else:
            assert failed.status_code == status, failed.text
            assert failed.json()["error"]["code"] == code
        if code == "rate_limited":
            assert failed.headers["retry-after"] == (script.retry_after or "7")
        assert API_KEY not in failed.text
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
        assert len(turns) == 1  # nothing of the failed turn was kept
        metrics = (await plain.get("/metrics")).text
        assert API_KEY not in metrics


async def test_a_prompt_too_long_for_gemini_is_context_length_exceeded(target: Target) -> None:
    api = FakeGeminiAPI(context_tokens=50)
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=GEMINI, input="word " * 400)
        assert refused.value.code == "context_length_exceeded"


async def test_a_refused_signature_is_retried_once_with_gemini_calls_translated(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After Gemini stops accepting the signatures it issued, the next turn is sent once more
    without earlier opaque parts: its calls translated with the placeholder, its thoughts left
    out; it commits, and /metrics counts the retry."""
    api = FakeGeminiAPI()
    async with sdk(target, everyone(api), models=MODELS) as (client, _, plain):
        conversation = await client.conversations.create()
        before = retries((await plain.get("/metrics")).text, GEMINI)
        api.then(calls(1))
        first = await client.responses.create(
            model=GEMINI,
            conversation=conversation.id,
            input="Q1",
            reasoning=THINK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        outputs: Any = [
            {"type": "function_call_output", "call_id": c.call_id, "output": "sun"}
            for c in first.output
            if c.type == "function_call"
        ]
        monkeypatch.setattr(fake_gemini, "SECRET", b"another project's key")
        api.then(answer(2))
        answered = await client.responses.create(
            model=GEMINI,
            conversation=conversation.id,
            input=outputs,
            reasoning=THINK,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        assert answered.output_text == "Answer 2"
        metrics = (await plain.get("/metrics")).text
    assert len(api.requests) == 3  # turn 2 refused once, then sent without earlier signatures
    retried = replayed(api)
    assert not any(p.get("thought") for p in retried)
    signatures = [p.get("thoughtSignature") for p in retried if "functionCall" in p]
    assert signatures == [fake_gemini.PLACEHOLDERS[0]] * 2
    assert retries(metrics, GEMINI) == before + 1


async def test_gemini_counts_input_tokens_and_refuses_what_it_cannot_honour(
    target: Target,
) -> None:
    """input_tokens is Gemini's countTokens; compaction and a field Gemini cannot honour are
    400 naming their param, before any call."""
    api = FakeGeminiAPI()
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        counted = await client.responses.input_tokens.count(
            model=GEMINI, input="hello there", instructions="Be brief."
        )
        assert counted.input_tokens > 0 and api.urls[-1].endswith(f"{GEMINI}:countTokens")
        refusals: list[tuple[dict[str, Any], str]] = [
            (
                {"context_management": [{"type": "compaction", "compact_threshold": 1}]},
                "context_management",
            ),
            ({"parallel_tool_calls": False}, "parallel_tool_calls"),
            ({"reasoning": {"effort": "none"}}, "reasoning.effort"),
            ({"top_logprobs": 2}, "top_logprobs"),
        ]
        for extra, param in refusals:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=GEMINI, input="hi", extra_body=extra)
            assert refused.value.param == param, extra
    assert all(url.endswith(":countTokens") for url in api.urls)  # no turn reached Gemini


async def test_text_format_and_sampling_reach_gemini_as_its_generation_config(
    target: Target,
) -> None:
    api = FakeGeminiAPI()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        api.then(Script([Text('{"a": "b"}')]))
        await client.responses.create(
            model=OLDER,
            input="json please",
            instructions="Answer in JSON.",
            temperature=0.5,
            top_p=0.9,
            max_output_tokens=300,
            reasoning={"effort": "low", "summary": "auto"},
            tool_choice={"type": "function", "name": "weather"},
            tools=TOOLS,
            text={"format": {"type": "json_schema", "name": "x", "schema": schema}},
        )
    sent = api.requests[-1]
    assert sent["generationConfig"] == {
        "temperature": 0.5,
        "topP": 0.9,
        "maxOutputTokens": 300,
        "responseMimeType": "application/json",
        "responseJsonSchema": schema,
        "thinkingConfig": {"thinkingBudget": 1024, "includeThoughts": True},
    }
    assert sent["systemInstruction"] == {"parts": [{"text": "Answer in JSON."}]}
    assert sent["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["weather"]}
    }


async def test_a_gemini_turn_stopped_by_max_tokens_is_incomplete(target: Target) -> None:
    api = FakeGeminiAPI()
    async with sdk(target, everyone(api), models=MODELS) as (client, _, _plain):
        api.then(Script([Text("Cut sh")], finish_reason="MAX_TOKENS"))
        answered = await client.responses.create(model=GEMINI, input="long story")
    assert answered.status == "incomplete"
    assert answered.incomplete_details is not None
    assert answered.incomplete_details.reason == "max_output_tokens"
    assert answered.usage is not None and answered.usage.output_tokens > 0
