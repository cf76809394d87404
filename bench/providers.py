"""Part 14, providers: what Anthropic's prompt cache saves a Claude conversation served by
turnstore, what Gemini's implicit cache saves a Gemini one, and what a Claude turn costs the
server next to a `fake-model` turn.

A `turnstore serve` process with PROVIDERS_FILE (the built-in fake and Claude) talks to the
strict fake Anthropic API of the tests (tests/support/fake_anthropic.py: it counts cache reads
and writes as the real API does, and refuses any replayed thinking block that differs from
what it issued), served over HTTP from this process. One /v1 conversation of ``TURNS`` Claude
turns with thinking (``reasoning.effort=low``), each with a ~6 KB user message; then as many
`fake-model` turns on a conversation of their own; the server's CPU per turn is the least of
``ROUNDS`` such conversations of each. Per Claude turn of the first, from its usage:

- read: what it read from the cache, over what the previous turn's request had in the cache
  (read plus written): the share of the earlier prompt it did not pay full price for;
- covered: cache reads plus writes over all its input tokens: what is billed at the full
  price is the rest (the newest input, and the newest reply until a later request carries it).

Then one conversation of ``TURNS`` Gemini 3 turns (the strict fake Gemini API,
tests/support/fake_gemini.py, with readable thoughts), which caches implicitly: a request
reads back the longest prefix an earlier request had, so per turn, read is its cached tokens
over the previous request's whole prompt (which Gemini holds from then on), and covered its
cached tokens over its own prompt. With a stable prefix (the request of turn N+1 begins with
turn N's, thought signatures and all) read stays at 100%.

Then one conversation of ``TURNS`` turns on the OpenAI Responses API (the fake of the tests,
tests/support/fakeapi.py, with sealed reasoning), which caches as OpenAI does: a request reads
back the longest prefix an earlier request had, of at least 1,024 tokens, in steps of 128
tokens. Read and covered as for Gemini (the previous request is held up to its last 128-token
step, so read can miss up to 127 tokens of it).

Per provider and shown turn, what the cache saves at list prices (``PRICES``): the turn's
input cost with the cache (reads at the cached price, Anthropic's writes at 1.25x) over its
cost without (every input token at the base price); and the same over the whole conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.database import sqlalchemy_url
from bench.server import free_port, process_cpu_s, running, turnstore_command
from bench.upstream import Served
from tests.support import fake_gemini
from tests.support.fake_anthropic import API_KEY, FakeMessagesAPI
from tests.support.fakeapi import FakeResponsesAPI

TURNS = 20
ROUNDS = 5  # conversations of each model, for the CPU per turn (psutil's CPU time ticks at 10 ms)
SHOWN = (2, 10, 20)
CLAUDE, FAKE, GEMINI, GPT = "claude-test", "fake-llm", "gemini-3-test", "gpt-test"
OPENAI_KEY = "sk-bench"
# A context budget the conversation outgrows (about 7 of its ~6 KB turns): the window must move
WINDOW_BYTES = 48_000
MESSAGE = "Tell me more about the history of the lighthouse. " * 120  # ~6 KB: past the
# smallest prompt Anthropic caches (1,024 tokens), so the first turn's request is cached too


@dataclass(frozen=True)
class Price:
    """List prices in USD per million input tokens: full price, a cache read, a cache write."""

    model: str
    base: float
    read: float
    write: float  # what a token written to the cache costs (Anthropic: 1.25x base, 5 minutes)
    source: str


# Published list prices of a current model per provider (standard tier, prompts up to 200k
# tokens), as the providers' price pages list them; read on 2026-12-07.
PRICES = {
    "OpenAI": Price(
        "gpt-5", 1.25, 0.125, 1.25, "https://openai.com/api/pricing (gpt-5: input, cached input)"
    ),
    "Claude": Price(
        "Claude Sonnet 4.5",
        3.00,
        0.30,
        3.75,
        "https://docs.claude.com/en/docs/about-claude/pricing (base input, 5m cache write "
        "1.25x, cache hit 0.1x)",
    ),
    "Gemini": Price(
        "Gemini 2.5 Pro",
        1.25,
        0.125,
        1.25,
        "https://ai.google.dev/gemini-api/docs/pricing (input, context caching; implicit "
        "caching bills no storage)",
    ),
}


@dataclass
class Cached:
    turn: int
    read: float  # of what the previous request had in the cache
    covered: float  # cache reads and writes, of the turn's input
    # The turn's input cost at list prices: with the cache, and with every token at full price
    cost: float = 0.0
    uncached_cost: float = 0.0
    written: float = 0.0  # cache writes (Anthropic's, billed at 1.25x), of the turn's input


@dataclass
class ProvidersResult:
    cached: list[Cached] = field(default_factory=list)
    gemini: list[Cached] = field(default_factory=list)
    openai: list[Cached] = field(default_factory=list)
    windowed: list[Cached] = field(default_factory=list)  # OpenAI, under WINDOW_BYTES
    claude_cpu_ms: float = 0.0
    fake_cpu_ms: float = 0.0
    fake_api_ms: float = 0.0  # the fake Anthropic's own time per call (in this process)


def _providers_file(path: Path, port: int, gemini_port: int, openai_port: int) -> Path:
    path.write_text(
        f'default_model = "{FAKE}"\n\n'
        f'[providers.local]\nkind = "fake"\nmodels = ["{FAKE}"]\n\n'
        f'[providers.claude]\nkind = "anthropic"\nbase_url = "http://127.0.0.1:{port}"\n'
        f'api_key_env = "BENCH_ANTHROPIC_KEY"\nmodels = ["{CLAUDE}"]\n\n'
        f'[providers.google]\nkind = "gemini"\nbase_url = "http://127.0.0.1:{gemini_port}"\n'
        f'api_key_env = "BENCH_GEMINI_KEY"\nmodels = ["{GEMINI}"]\n\n'
        f'[providers.openai]\nkind = "openai"\nbase_url = "http://127.0.0.1:{openai_port}/v1"\n'
        f'api_key_env = "BENCH_OPENAI_KEY"\nmodels = ["{GPT}"]\n'
    )
    return path


async def _turns(port: int, pid: int, model: str) -> tuple[list[dict[str, Any]], float]:
    """``TURNS`` turns of one conversation on ``model``: each turn's usage, and the server's
    CPU per turn (ms)."""
    usages = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        conversation = (await client.post("/v1/conversations", json={})).json()["id"]
        cpu = process_cpu_s(pid)
        for n in range(1, TURNS + 1):
            body = {"model": model, "conversation": conversation, "input": f"{n}. {MESSAGE}"}
            if model in (CLAUDE, GPT):
                body["reasoning"] = {"effort": "low"}
            elif model == GEMINI:
                body["reasoning"] = {"effort": "low", "summary": "auto"}
            answered = await client.post("/v1/responses", json=body)
            answered.raise_for_status()
            usages.append(answered.json()["usage"])
        return usages, (process_cpu_s(pid) - cpu) * 1000 / TURNS


def run(url: str, log_dir: Path) -> ProvidersResult:
    api = FakeMessagesAPI(min_cache_tokens=1024)
    google = fake_gemini.FakeGeminiAPI(min_cache_tokens=1024)
    result = ProvidersResult()
    with Served(api) as served, Served(google) as gemini, Served(FakeResponsesAPI()) as gpt:
        port = free_port()
        listed = _providers_file(log_dir / "providers.toml", served.port, gemini.port, gpt.port)
        env = {
            "DATABASE_URL": sqlalchemy_url(url),
            "PROVIDERS_FILE": str(listed),
            "BENCH_ANTHROPIC_KEY": API_KEY,
            "BENCH_GEMINI_KEY": fake_gemini.API_KEY,
            "BENCH_OPENAI_KEY": OPENAI_KEY,
        }
        command = [*turnstore_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
        with running(command, port, env, log_dir / "providers.log") as pid:
            usages, cpu = asyncio.run(_turns(port, pid, CLAUDE))
            claude = [cpu, *(asyncio.run(_turns(port, pid, CLAUDE))[1] for _ in range(ROUNDS - 1))]
            fake = [asyncio.run(_turns(port, pid, FAKE))[1] for _ in range(ROUNDS)]
            result.claude_cpu_ms, result.fake_cpu_ms = min(claude), min(fake)
            gemini_usages, _ = asyncio.run(_turns(port, pid, GEMINI))
            openai_usages, _ = asyncio.run(_turns(port, pid, GPT))
        result.fake_api_ms = served.handled_s * 1000 / (TURNS * ROUNDS)
        env["CONTEXT_MAX_REQUEST_BYTES"] = str(WINDOW_BYTES)
        with running(command, port, env, log_dir / "providers-windowed.log") as pid:
            windowed_usages, _ = asyncio.run(_turns(port, pid, GPT))
    result.windowed = prefix_shares(windowed_usages, PRICES["OpenAI"])
    result.gemini = prefix_shares(gemini_usages, PRICES["Gemini"])
    result.openai = prefix_shares(openai_usages, PRICES["OpenAI"])
    price = PRICES["Claude"]
    for n in range(2, TURNS + 1):
        before, now = usages[n - 2]["input_tokens_details"], usages[n - 1]
        details = now["input_tokens_details"]
        had = before["cached_tokens"] + before["cache_write_tokens"]
        read, written = details["cached_tokens"], details["cache_write_tokens"]
        result.cached.append(
            Cached(
                n,
                read / had,
                (read + written) / now["input_tokens"],
                *_costs(now["input_tokens"], read, written, price),
                written / now["input_tokens"],
            )
        )
    return result


def _costs(tokens: int, read: int, written: int, price: Price) -> tuple[float, float]:
    """A turn's input cost (USD) with the cache and with every token at the full price."""
    full = tokens - read - written
    cost = full * price.base + read * price.read + written * price.write
    return cost / 1e6, tokens * price.base / 1e6


def prefix_shares(usages: list[dict[str, Any]], price: Price) -> list[Cached]:
    """For a provider that caches by prefix (Gemini, OpenAI), per turn from the second: its
    cache reads over the previous request's whole prompt (read), and over its own (covered)."""
    shares = []
    for n in range(2, len(usages) + 1):
        before, now = usages[n - 2], usages[n - 1]
        cached = now["input_tokens_details"]["cached_tokens"]
        tokens = now["input_tokens"]
        shares.append(
            Cached(
                n,
                cached / before["input_tokens"],
                cached / tokens,
                *_costs(tokens, cached, 0, price),
            )
        )
    return shares


def _provider_lines(name: str, rows: list[Cached]) -> Iterator[str]:
    price = PRICES[name]
    for row in rows:
        if row.turn in SHOWN:
            yield (
                f"{name} turn {row.turn:2}: read back {row.read:6.1%} of the previous request; "
                f"full price on {1 - row.covered:6.1%} of its input"
                + (f" (written at 1.25x: {row.written:5.1%})" if row.written else "")
                + "; input cost with the cache "
                f"${row.cost * 1000:.3f} / without ${row.uncached_cost * 1000:.3f} per 1,000 "
                f"turns (x{row.cost / row.uncached_cost:.2f})"
            )
    cost = sum(row.cost for row in rows)
    uncached = sum(row.uncached_cost for row in rows)
    yield (
        f"{name} turns 2-{TURNS} at {price.model}'s list prices: input costs "
        f"x{cost / uncached:.2f} of what it would without the cache"
    )
    worst = min(rows, key=lambda row: row.read)
    yield (
        f"{name}'s lowest read share from turn 2 on: {worst.read:.1%} (turn {worst.turn}); "
        "target >= 90%"
    )


def lines(result: ProvidersResult) -> Iterator[str]:
    yield from _provider_lines("Claude", result.cached)
    yield from _provider_lines("Gemini", result.gemini)
    yield from _provider_lines("OpenAI", result.openai)
    moved = [row for row in result.windowed if row.read < 0.9]
    cost = sum(row.cost for row in result.windowed)
    uncached = sum(row.uncached_cost for row in result.windowed)
    yield (
        f"OpenAI with CONTEXT_MAX_REQUEST_BYTES={WINDOW_BYTES:,}: {len(moved)} of "
        f"{len(result.windowed)} turns read back under 90% (turns "
        f"{', '.join(str(row.turn) for row in moved) or 'none'}: the window moved); input costs "
        f"x{cost / uncached:.2f} of what it would without the cache"
    )
    for name, price in PRICES.items():
        yield (
            f"prices ({name}, {price.model}, USD per million input tokens): full {price.base}, "
            f"cache read {price.read}, cache write {price.write}; {price.source}"
        )
    ratio = result.claude_cpu_ms / result.fake_cpu_ms
    yield (
        f"server CPU per turn (least of {ROUNDS} conversations): Claude "
        f"{result.claude_cpu_ms:.2f} ms, fake-model {result.fake_cpu_ms:.2f} ms (x{ratio:.2f}); "
        f"the fake API's own {result.fake_api_ms:.2f} ms a call (in the bench process)"
    )
