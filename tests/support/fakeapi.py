"""A fake OpenAI Responses API behind ``httpx.MockTransport``: the real ResponsesProvider
code runs against it, and each call answers what a test scripted for it.

Every call records the decoded request body; ``Script`` says how one call answers. Bodies and
stream events follow the wire format: ``tests/unit/test_fakeapi_wire_format.py`` checks them
against the ``openai`` SDK's models. Like the real API, a response echoes ``store``.

Prompt caching, as OpenAI's works (its prompt caching guide): automatic, per model, on an
exact prefix of the prompt of at least 1,024 tokens, hit in increments of 128 tokens. The
prompt is what the model reads, in its order: the reasoning settings, the instructions, the
tools, the output format (``text``), then each input item (each as canonical JSON: key order
and whitespace do not matter, as they do not to the real renderer); tokens are
``estimate_tokens``' (UTF-8 bytes / 4). A create request reads back the longest prefix of its
prompt, ending at 1,024 + 128k tokens, that an earlier request of the same model had, and
caches each of its own such prefixes; ``usage.input_tokens_details.cached_tokens`` says how
much it read. A prompt under ``min_cache_tokens`` keeps the flat usage the tests expect
(10 tokens in, 5 out, none cached); a longer one reports its estimated size, so cached tokens
never exceed input tokens. Entries never expire (no clock).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.providers.openai_responses import Endpoint, ResponsesProvider
from service.providers.wire import WireLimits
from tests.support.fake_anthropic import canonical

TOKEN_BYTES = 4  # estimate_tokens': UTF-8 bytes of canonical JSON / 4


@dataclass
class Script:
    text: str | None = None  # None: "reply <call number>"
    status: str = "completed"  # completed | incomplete | failed
    incomplete_reason: str | None = None
    http_status: int = 200
    error_code: str | None = None  # error.code of a non-2xx body (or of a stream's error event)
    error_param: str | None = None  # error.param of a non-2xx body: the field at fault
    headers: dict[str, str] = field(default_factory=dict)
    reasoning: bool = True
    deltas: int = 3
    break_stream: bool = False  # the stream ends without a terminal event
    raw_body: bytes | None = None  # answer exactly these bytes
    exception: Exception | None = None  # raised by the transport, e.g. httpx.ReadTimeout
    calls: list[tuple[str, str]] | None = None  # function calls (name, arguments) instead of text
    gate: asyncio.Event | None = None  # wait for it before answering (after `started` is set)
    stall: asyncio.Event | None = None  # streaming: wait for it after sending the first delta
    drip_s: float = 0.0  # streaming: this long between two deltas (a provider that types)
    sent: list[float] = field(default_factory=list)  # streaming: when each delta went out
    started: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # the client closed the stream


class FakeResponsesAPI:
    def __init__(self, *, min_cache_tokens: int = 1024, cache_increment: int = 128) -> None:
        self.min_cache_tokens, self.cache_increment = min_cache_tokens, cache_increment
        self._cache: set[str] = set()  # digests of (model, cached prefix)
        self.requests: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []  # the raw request bodies, for byte budgets
        self.headers: list[httpx.Headers] = []
        self.urls: list[str] = []
        self.methods: list[str] = []
        self._scripts: deque[Script] = deque()
        self._ids = itertools.count(1)

    def then(self, *scripts: Script) -> FakeResponsesAPI:
        self._scripts.extend(scripts)
        return self

    def anew(self, *scripts: Script) -> FakeResponsesAPI:
        """Forget the requests seen and the answers not given yet; these answers next."""
        for seen in (self.requests, self.bodies, self.headers, self.urls, self.methods):
            seen.clear()
        self._scripts.clear()
        return self.then(*scripts)

    def provider(self, model: str = "gpt-test", **kwargs: Any) -> ResponsesProvider:
        endpoint = Endpoint.openai("https://fake.invalid/v1", "sk-test", model)
        options = {"connect_timeout_s": 1.0, "read_timeout_s": 5.0, "max_body_bytes": 262_144}
        limits = WireLimits(**(options | kwargs))
        return ResponsesProvider(endpoint, limits, transport=httpx.MockTransport(self.handle))

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.bodies.append(body)
        self.requests.append(json.loads(body))
        self.headers.append(request.headers)
        self.urls.append(str(request.url))
        self.methods.append(request.method)
        script = self._scripts.popleft() if self._scripts else Script()
        number = next(self._ids)
        script.started.set()
        if script.gate is not None:
            await script.gate.wait()
        if script.exception is not None:
            raise script.exception
        if script.raw_body is not None:
            return httpx.Response(
                script.http_status, content=script.raw_body, headers=script.headers
            )
        if script.http_status >= 400:
            error = {
                "error": {
                    "message": "upstream says no",
                    "type": "invalid_request_error" if script.http_status < 500 else "server_error",
                    "param": script.error_param,
                    "code": script.error_code,
                }
            }
            return httpx.Response(script.http_status, json=error, headers=script.headers)
        if request.url.path.endswith("/responses/input_tokens"):  # 10 tokens an input item
            counted = 10 * len(json.loads(body)["input"])
            return httpx.Response(
                200, json={"object": "response.input_tokens", "input_tokens": counted}
            )
        if request.url.path.endswith("/responses/compact"):
            return httpx.Response(200, json=compaction(number, json.loads(body)))
        text = f"reply {number}" if script.text is None else script.text
        if script.calls is not None:
            text = ""
        items = output_items(number, text, reasoning=script.reasoning, status=script.status)
        items += [
            function_call(number, i, name, args)
            for i, (name, args) in enumerate(script.calls or ())
        ]
        response = response_object(number, script, items)
        prompt, cached = self.cached(json.loads(body))
        if prompt >= self.min_cache_tokens:
            usage = response["usage"]
            usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"] = prompt, cached
            usage["total_tokens"] = prompt + usage["output_tokens"]
        if json.loads(body).get("stream"):  # this request's own body: calls may interleave
            events = stream_events(response, items, text, script)
            headers = {**script.headers, "content-type": "text/event-stream"}
            return httpx.Response(200, headers=headers, stream=_SSEStream(events, script))
        return httpx.Response(200, json=response, headers=script.headers)

    def cached(self, body: dict[str, Any]) -> tuple[int, int]:
        """A create request's prompt tokens, and how many of them it reads back from the cache:
        the longest prefix ending at ``min_cache_tokens`` + k * ``cache_increment`` tokens
        that an earlier request of the same model had. Caches this prompt's own such prefixes.
        """
        prompt = prompt_bytes(body)
        tokens = max(1, math.ceil(len(prompt) / TOKEN_BYTES))
        running = hashlib.sha256(str(body.get("model")).encode() + b"\0")
        read, done, hit = 0, 0, True
        for end in range(self.min_cache_tokens, tokens + 1, self.cache_increment):
            running.update(prompt[done * TOKEN_BYTES : end * TOKEN_BYTES])
            digest, done = running.hexdigest(), end
            hit = hit and digest in self._cache  # a prefix hits only if all shorter ones do
            read = end if hit else read
            self._cache.add(digest)
        return tokens, read


def prompt_bytes(body: dict[str, Any]) -> bytes:
    """The prompt as the cache sees it, in the order the model reads it: the reasoning
    settings, the instructions, the tools, the output format, then each input item (a string
    input as one user message), each as canonical JSON."""
    items = body.get("input", [])
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    head = [
        {"reasoning": body.get("reasoning")},
        {"instructions": body.get("instructions")},
        {"tools": body.get("tools")},
        {"text": body.get("text")},
    ]
    return b"".join(canonical(block) for block in [*head, *items])


def openai_id(prefix: str, *parts: object) -> str:
    """An id shaped as the Responses API's: a prefix and 48 hex digits (``rs_6820f3...``), one
    per ``parts``."""
    seed = ":".join(map(str, (prefix, *parts))).encode()
    return f"{prefix}_{hashlib.sha256(seed).hexdigest()[:48]}"


def output_items(
    number: int, text: str, *, reasoning: bool, status: str = "completed"
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(
            {
                "id": openai_id("rs", number),
                "type": "reasoning",
                "summary": [],
                "encrypted_content": f"gAAA-sealed-{number}==",
            }
        )
    if text:
        # The message of an incomplete response (cut off by max_output_tokens) is incomplete too.
        items.append({
            "id": openai_id("msg", number), "type": "message", "role": "assistant",
            "status": "incomplete" if status == "incomplete" else "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        })  # fmt: skip
    return items


def function_call(number: int, index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": openai_id("fc", number, index), "type": "function_call", "status": "completed",
        "call_id": f"call_{number}_{index}", "name": name, "arguments": arguments,
    }  # fmt: skip


def compaction(number: int, request: dict[str, Any]) -> dict[str, Any]:
    """``POST /responses/compact``: the input's user messages, then one compaction item."""
    kept = [item for item in request["input"] if item.get("role") == "user"]
    item = {
        "type": "compaction", "id": openai_id("cmp", number),
        "encrypted_content": f"gAAA-compacted-{number}==",
    }  # fmt: skip
    usage = response_object(number, Script(), [])["usage"]
    return {
        "id": openai_id("resp", number), "object": "response.compaction", "created_at": 1764460000,
        "output": [*kept, item], "usage": usage,
    }  # fmt: skip


def response_object(number: int, script: Script, items: list[dict[str, Any]]) -> dict[str, Any]:
    incomplete = {"reason": script.incomplete_reason} if script.incomplete_reason else None
    error = {"code": "server_error", "message": "boom"} if script.status == "failed" else None
    return {
        "id": openai_id("resp", number), "object": "response", "created_at": 1764460000, "model": "gpt-test",
        "status": script.status, "incomplete_details": incomplete, "error": error,
        "output": items, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "store": False, "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 2}},
    }  # fmt: skip


def stream_events(
    response: dict[str, Any], items: list[dict[str, Any]], text: str, script: Script
) -> list[dict[str, Any]]:
    """The events of one streamed response, in the API's order: ``response.created``,
    ``response.in_progress``, then per output item ``output_item.added`` (for a message:
    ``content_part.added``, ``output_text.delta``..., ``output_text.done``,
    ``content_part.done``) and ``output_item.done``; last one terminal event (or ``error``)."""
    seq = itertools.count()
    in_progress = {
        **response,
        "status": "in_progress",
        "output": [],
        "incomplete_details": None,
        "error": None,
        "usage": None,
    }
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": in_progress},
        {"type": "response.in_progress", "response": in_progress},
    ]
    for index, item in enumerate(items):
        if item["type"] == "message":
            added = {**item, "status": "in_progress", "content": []}
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": added}
            )
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = item["content"][0]
            events.append(
                {"type": "response.content_part.added", **where, "part": {**part, "text": ""}}
            )
            size = max(1, -(-len(text) // script.deltas))
            for start in range(0, len(text), size):
                delta = text[start : start + size]
                events.append(
                    {"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []}
                )
            events.append(
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
            )
            events.append({"type": "response.content_part.done", **where, "part": part})
        elif item["type"] == "function_call":
            added = {**item, "status": "in_progress", "arguments": ""}
            events.append(
                {"type": "response.output_item.added", "output_index": index, "item": added}
            )
            where = {"item_id": item["id"], "output_index": index}
            half = len(item["arguments"]) // 2
            for delta in (item["arguments"][:half], item["arguments"][half:]):
                events.append(
                    {"type": "response.function_call_arguments.delta", **where, "delta": delta}
                )
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": item["arguments"],
                    "name": item["name"],
                }
            )
        else:
            # The .added copy of a reasoning item lacks its encrypted_content: only .done is whole.
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "encrypted_content": None},
                }
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    if script.error_code is not None:
        events.append(
            {
                "type": "error",
                "code": script.error_code,
                "message": "upstream says no",
                "param": None,
            }
        )
    elif not script.break_stream:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            script.status, "response.failed"
        )
        events.append({"type": kind, "response": response})
    for event in events:
        event["sequence_number"] = next(seq)
    return events


class _SSEStream(httpx.AsyncByteStream):
    """The events as server-sent events, one per chunk. httpx closes a response's stream when
    its body was read to the end or the client closed the response early; either sets
    ``script.closed`` (an async generator passed as ``content`` would be closed only by the
    garbage collector)."""

    def __init__(self, events: list[dict[str, Any]], script: Script) -> None:
        self._events = events
        self._script = script

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events:
            delta = event["type"] == "response.output_text.delta"
            if delta:
                self._script.sent.append(time.monotonic())
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            await asyncio.sleep(self._script.drip_s if delta else 0)
            if self._script.stall is not None and delta:
                await self._script.stall.wait()  # the client may hang up meanwhile

    async def aclose(self) -> None:
        self._script.closed.set()
