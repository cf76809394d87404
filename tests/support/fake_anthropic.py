"""A strict fake Anthropic Messages API behind ``httpx.MockTransport``: ``POST /v1/messages``
(JSON or server-sent events) and ``POST /v1/messages/count_tokens``, as the real API shapes
them, refusing what the real API refuses with its ``400 invalid_request_error`` body.

Every call records the decoded request body and its headers; ``Script`` says how one call
answers (the blocks of the reply, its ``stop_reason``, or an HTTP error). The wire format
follows the official ``anthropic`` SDK's models: ``tests/unit/test_fake_anthropic_wire_format.py``
parses every answer with the SDK and runs each refusal below.

What the fake checks, in this order (the first failure answers):

- headers: the key, as ``x-api-key`` or ``Authorization: Bearer`` (missing or wrong: ``401
  authentication_error``), ``anthropic-version`` (``2023-06-01`` or the SDK's ``2026-10-21``); the path (else ``404 not_found_error``); a JSON object body; the model
  (unknown: ``404 not_found_error``, as the real API). A scripted HTTP error or transport
  exception answers next, whatever the body; a refused request does not use up a script.
- the body: required fields (``max_tokens``, ``messages``, ``model``), no unknown top-level
  field, ``system`` a string or a list of text blocks, each message's role and content,
  each block's required and allowed fields (``cache_control`` on ``thinking`` /
  ``redacted_thinking`` is an extra input), empty text, ``tool_use`` ids' pattern, the
  thinking settings (``budget_tokens`` >= 1024 and < ``max_tokens``, ``temperature`` 1).
- consecutive same-role messages are merged into one turn before the checks below, as the
  real API does (its docs: "Consecutive user or assistant turns in your request will be
  combined into a single turn"); an assistant first message is allowed (the first-party API
  accepts it; only Bedrock refused it). Error paths still name the request's own indexes.
- opaque blocks: a ``thinking`` block's ``signature`` is ``signature_of(model, thinking)``
  (an HMAC under the fake's secret), a ``redacted_thinking`` block's ``data`` carries its own
  HMAC over (model, hidden bytes): a byte changed, a merge of two blocks or a replay to
  another model is ``Invalid `signature` in `thinking` block``. The thinking blocks of the
  latest assistant message must be those of the reply they came from, all of them, in order
  (the fake remembers what it issued): a dropped or reordered block is refused.
- tools: each assistant ``tool_use`` must be answered by a ``tool_result`` of the same id in
  the leading run of ``tool_result`` blocks of the next (merged) user message, and each
  ``tool_result`` must answer a ``tool_use`` of the message just before it.
- thinking enabled: when the final assistant message holds a ``tool_use``, it must start
  with a ``thinking`` or ``redacted_thinking`` block.
- prompt caching: at most 4 ``cache_control`` breakpoints (a top-level ``cache_control``
  places one on the last cacheable block). The prompt is a list of blocks in the API's
  order (tools, system, then a zero-token block for the thinking and tool_choice settings,
  whose change invalidates the message cache, then each message's content blocks, each with
  its role); a prefix's key is a running SHA-256 over the canonical JSON of its blocks
  (``cache_control`` left out; key order and whitespace do not matter, as to the real
  tokenizer). Per model, a request reads the longest cached prefix ending at one of its
  breakpoints or up to 19 blocks before one (the real 20-block lookback), writes every
  breakpoint's prefix of at least ``min_cache_tokens`` tokens, and reports
  ``cache_read_input_tokens`` (the hit), ``cache_creation_input_tokens`` (from the hit to its
  last breakpoint) and ``input_tokens`` (the rest). Entries never expire (no clock).
- the prompt's size: ``prompt is too long: N tokens > M maximum``; tokens are
  ``estimate_tokens`` of each block (UTF-8 bytes of its canonical JSON / 4, rounded up).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import math
import string
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

SECRET = b"fake-anthropic-signing-key"
# The version turnstore sends, and the one the anthropic SDK 2.17 sends (with its key as
# `Authorization: Bearer`): the fake accepts both, and either way of sending the key.
VERSIONS = ("2023-06-01", "2026-10-21")
API_KEY = "sk-ant-api03-test"
MODELS = ("claude-test", "claude-other")
THINKING_DOCS = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
BASE62 = string.digits + string.ascii_uppercase + string.ascii_lowercase
LOOKBACK = 20  # blocks the real API checks for a cache hit at and before each breakpoint
TOP_LEVEL = {
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
    "temperature", "top_k", "top_p", "tools", "tool_choice", "thinking", "service_tier",
    "cache_control", "container", "mcp_servers", "output_config", "inference_geo",
    "context_management",
}  # fmt: skip
# The fields a request block of each type may have; types not listed are not checked.
BLOCK_FIELDS: dict[str, tuple[set[str], set[str]]] = {  # type: (required, allowed)
    "text": ({"text"}, {"cache_control", "citations"}),
    "thinking": ({"thinking", "signature"}, set()),
    "redacted_thinking": ({"data"}, set()),
    "tool_use": ({"id", "name", "input"}, {"cache_control", "caller"}),
    "tool_result": ({"tool_use_id"}, {"content", "is_error", "cache_control"}),
    "image": ({"source"}, {"cache_control"}),
    "document": ({"source"}, {"cache_control", "title", "context", "citations"}),
}
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 529: "overloaded_error",
}  # fmt: skip
ERROR_MESSAGES = {
    "rate_limit_error": "This request would exceed the rate limit for your organization of 50 "
    "input tokens per minute. Please try again later.",
    "overloaded_error": "Overloaded",
    "api_error": "Internal server error",
    "request_too_large": "Request exceeds the maximum allowed number of bytes.",
    "permission_error": "Your API key does not have permission to use the specified resource.",
}


# Reply blocks a script is made of.
@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Thinking:
    thinking: str  # "" is a block whose thinking is omitted: an empty text and a signature


@dataclass(frozen=True)
class Redacted:
    hidden: str = "flagged reasoning"  # sealed into `data`, never shown


@dataclass(frozen=True)
class ToolUse:
    name: str
    input: dict[str, Any] = field(default_factory=dict)


Block = Text | Thinking | Redacted | ToolUse


@dataclass
class Script:
    blocks: list[Block] | None = None  # None: a thinking block (if enabled), "reply <n>"
    stop_reason: str | None = None  # None: "tool_use" if a ToolUse is scripted, else "end_turn"
    stop_sequence: str | None = None
    http_status: int = 200
    error_type: str | None = None  # of a non-2xx body (default: the status's), or mid-stream
    message: str | None = None  # the error's message
    retry_after: str | None = None  # the retry-after header (429 default: "30")
    headers: dict[str, str] = field(default_factory=dict)
    deltas: int = 3  # streaming: text and thinking come in this many deltas each
    raw_body: bytes | None = None
    exception: Exception | None = None  # raised by the transport, e.g. httpx.ReadTimeout


class Refused(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def estimate_tokens(value: object) -> int:
    """The fake's tokenizer: a string's UTF-8 bytes, or any other value's canonical JSON, / 4."""
    size = len(value.encode() if isinstance(value, str) else canonical(value))
    return max(1, math.ceil(size / 4))


def _mac(*parts: str | bytes) -> bytes:
    data = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(SECRET, data, hashlib.sha256).digest()


def signature_of(model: str, thinking: str) -> str:
    """The signature of a thinking block: keyed digests of the model and the exact text."""
    return base64.b64encode(
        b"\x12\x40" + _mac("sig", model, thinking) + _mac("pad", model, thinking)
    ).decode()


def _sealed(model: str, payload: bytes) -> bytes:
    """The payload XORed with a keystream of the model: opaque, and its own inverse."""
    stream = b"".join(_mac("stream", model, str(i)) for i in range(len(payload) // 32 + 1))
    return bytes(a ^ b for a, b in zip(payload, stream, strict=False))


def redacted_data(model: str, hidden: str) -> str:
    """A redacted_thinking block's ``data``: the hidden bytes sealed, with their HMAC."""
    payload = hidden.encode()
    return base64.b64encode(
        b"\x0a" + _mac("red", model, payload) + _sealed(model, payload)
    ).decode()


def _redacted_valid(model: str, data: str) -> bool:
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        return False
    payload = _sealed(model, raw[33:])
    sealed = raw[:1] == b"\x0a" and hmac.compare_digest(raw[1:33], _mac("red", model, payload))
    return sealed and base64.b64encode(raw).decode() == data  # canonical: no spare bits


def mint_id(prefix: str, *parts: object) -> str:
    """``msg_01`` / ``toolu_01`` / ``req_011C`` and base62 characters, as the real ids."""
    number = int.from_bytes(_mac(prefix, ":".join(map(str, parts))))
    size = 20 if prefix == "req_011C" else 22
    return prefix + "".join(BASE62[(number >> (6 * i)) % 62] for i in range(size))


@dataclass
class _Turn:
    role: str
    blocks: list[
        tuple[str, dict[str, Any]]
    ]  # (the request's path, e.g. "messages.3.content.0", block)
    index: int  # of the request's first message merged into this turn


class FakeMessagesAPI:
    def __init__(
        self,
        *,
        models: tuple[str, ...] = MODELS,
        api_key: str = API_KEY,
        context_tokens: int = 200_000,
        min_cache_tokens: int = 1024,
    ) -> None:
        self.models, self.api_key = models, api_key
        self.context_tokens, self.min_cache_tokens = context_tokens, min_cache_tokens
        self.requests: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []
        self.headers: list[httpx.Headers] = []
        self.urls: list[str] = []
        self.methods: list[str] = []
        self._scripts: deque[Script] = deque()
        self._ids = itertools.count(1)
        self._cache: set[tuple[str, str]] = set()  # (model, prefix digest)
        self._issued: dict[str, tuple[str, ...]] = {}  # opaque value -> its reply's, in order

    def then(self, *scripts: Script) -> FakeMessagesAPI:
        self._scripts.extend(scripts)
        return self

    def _next(self) -> None:
        if self._scripts:
            self._scripts.popleft()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.bodies.append(body)
        self.headers.append(request.headers)
        self.urls.append(str(request.url))
        self.methods.append(request.method)
        number = next(self._ids)
        request_id = mint_id("req_011C", number)
        try:
            parsed = self._accept(request, body)
            if request.url.path == "/v1/messages/count_tokens":
                _, tokens = self._check(parsed, count_only=True)
                return _json(200, {"input_tokens": sum(tokens)}, request_id)
            script = self._scripts[0] if self._scripts else Script()
            if script.exception is not None or script.http_status != 200 or script.raw_body:
                self._next()
                return _scripted(script, request_id)
            turns, tokens = self._check(parsed, count_only=False)
        except Refused as refused:
            return _error(refused.status, None, refused.message, request_id)
        self._next()
        usage = self._usage(parsed, turns, tokens)
        message = self._reply(number, parsed, script, usage)
        headers = {**script.headers, "request-id": request_id}
        if not parsed.get("stream"):
            return httpx.Response(200, json=message, headers=headers)
        headers["content-type"] = "text/event-stream; charset=utf-8"
        events = stream_events(message, script)
        return httpx.Response(200, headers=headers, stream=_SSEStream(events))

    # -- the request -------------------------------------------------------------------------

    def _accept(self, request: httpx.Request, body: bytes) -> dict[str, Any]:
        key = request.headers.get("x-api-key")
        bearer = request.headers.get("authorization", "")
        if key is None and bearer.startswith("Bearer "):
            key = bearer.removeprefix("Bearer ")
        if key is None:
            raise Refused("x-api-key header is required", 401)
        if key != self.api_key:
            raise Refused("invalid x-api-key", 401)
        version = request.headers.get("anthropic-version")
        if version is None:
            raise Refused("anthropic-version: header is required")
        if version not in VERSIONS:
            raise Refused(f"anthropic-version: invalid version '{version}'")
        if request.method != "POST" or request.url.path not in (
            "/v1/messages",
            "/v1/messages/count_tokens",
        ):
            raise Refused(f"Not Found: {request.method} {request.url.path}", 404)
        if not request.headers.get("content-type", "").startswith("application/json"):
            raise Refused("content-type: expected application/json")
        try:
            parsed = json.loads(body)
        except ValueError as error:
            raise Refused(f"Invalid JSON in request body: {error}") from None
        if not isinstance(parsed, dict):
            raise Refused("Input should be an object")
        self.requests.append(parsed)
        if isinstance(parsed.get("model"), str) and parsed["model"] not in self.models:
            raise Refused(f"model: {parsed['model']}", 404)
        return parsed

    def _check(self, body: dict[str, Any], *, count_only: bool) -> tuple[list[_Turn], list[int]]:
        """Every refusal the body earns, first found first; else the merged turns and the
        prompt's blocks' token counts (as `_blocks` lists them)."""
        required = ("messages", "model") if count_only else ("max_tokens", "messages", "model")
        allowed = TOP_LEVEL - {"max_tokens", "stream"} if count_only else TOP_LEVEL
        for name in required:
            if name not in body:
                raise Refused(f"{name}: Field required")
        for name in body:
            if name not in allowed:
                raise Refused(f"{name}: Extra inputs are not permitted")
        if not count_only and (not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1):
            raise Refused("max_tokens: Input should be greater than or equal to 1")
        _check_system(body.get("system"))
        thinking = _check_thinking(body)
        turns = _turns(body["messages"])
        model = body["model"]
        for turn in turns:
            for path, block in turn.blocks:
                self._check_block(path, block, model)
        _check_tool_pairs(turns)
        if thinking:
            _check_final_thinking(turns)
        self._check_latest_unmodified(turns)
        _check_breakpoints(body)
        tokens = [estimate_tokens(_unmarked(block)) for block in _blocks(body, turns)]
        if sum(tokens) > self.context_tokens:
            raise Refused(
                f"prompt is too long: {sum(tokens)} tokens > {self.context_tokens} maximum"
            )
        return turns, tokens

    def _check_block(self, path: str, block: dict[str, Any], model: str) -> None:
        kind = block.get("type")
        if kind not in BLOCK_FIELDS:
            return
        required, allowed = BLOCK_FIELDS[kind]
        for name in sorted(required - set(block)):
            raise Refused(f"{path}.{kind}.{name}: Field required")
        for name in sorted(set(block) - required - allowed - {"type"}):
            raise Refused(f"{path}.{kind}.{name}: Extra inputs are not permitted")
        if kind == "text" and block["text"] == "":
            raise Refused("messages: text content blocks must be non-empty")
        if kind == "thinking" and block["signature"] != signature_of(model, block["thinking"]):
            raise Refused(f"{path}: Invalid `signature` in `thinking` block")
        if kind == "redacted_thinking" and not _redacted_valid(model, block["data"]):
            raise Refused(f"{path}: Invalid `data` in `redacted_thinking` block")
        if kind == "tool_use":
            if not isinstance(block["id"], str) or not _token_id(block["id"]):
                raise Refused(f"{path}.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'")
            if not isinstance(block["input"], dict):
                raise Refused(f"{path}.tool_use.input: Input should be a valid dictionary")

    def _check_latest_unmodified(self, turns: list[_Turn]) -> None:
        """The latest assistant turn's thinking blocks are each whole reply's, in order."""
        latest = next((t for t in reversed(turns) if t.role == "assistant"), None)
        if latest is None:
            return
        sent = [(path, _opaque(block)) for path, block in latest.blocks if _opaque(block)]
        expected: list[str] = []
        for _, value in sent:
            reply = self._issued.get(value, (value,))
            if reply[0] not in expected:
                expected += reply
        for position, want in enumerate(expected):
            if position >= len(sent) or sent[position][1] != want:
                path = sent[min(position, len(sent) - 1)][0]
                raise Refused(
                    f"{path}: `thinking` or `redacted_thinking` blocks in the latest assistant "
                    "message cannot be modified. These blocks must remain as they were in the "
                    "original response."
                )

    # -- the answer --------------------------------------------------------------------------

    def _usage(self, body: dict[str, Any], turns: list[_Turn], tokens: list[int]) -> dict[str, Any]:
        blocks = _blocks(body, turns)
        breakpoints = [i for i, block in enumerate(blocks) if "cache_control" in block]
        running, digests, totals = hashlib.sha256(body["model"].encode()), [], []
        for block, count in zip(blocks, tokens, strict=True):
            running.update(canonical(_unmarked(block)))
            digests.append(running.hexdigest())
            totals.append((totals[-1] if totals else 0) + count)
        model, read = body["model"], 0
        for point in breakpoints:
            for i in range(point, max(-1, point - LOOKBACK), -1):
                if (model, digests[i]) in self._cache:
                    read = max(read, totals[i])
                    break
        written = 0
        if breakpoints and totals[breakpoints[-1]] >= self.min_cache_tokens:
            written = max(0, totals[breakpoints[-1]] - read)
        for point in breakpoints:
            if totals[point] >= self.min_cache_tokens:
                self._cache.add((model, digests[point]))
        ttl_1h = bool(written) and blocks[breakpoints[-1]]["cache_control"].get("ttl") == "1h"
        return {
            "input_tokens": sum(tokens) - read - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": 0 if ttl_1h else written,
                "ephemeral_1h_input_tokens": written if ttl_1h else 0,
            },
        }

    def _reply(
        self, number: int, body: dict[str, Any], script: Script, usage: dict[str, Any]
    ) -> dict[str, Any]:
        model = body["model"]
        thinking = body.get("thinking", {}).get("type") in ("enabled", "adaptive")
        scripted = script.blocks
        if scripted is None:
            scripted = [Thinking(f"thinking {number}"), Text(f"reply {number}")]
        content: list[dict[str, Any]] = []
        for block in scripted:
            if isinstance(block, Text):
                content.append({"type": "text", "text": block.text})
            elif isinstance(block, Thinking) and thinking:
                sig = signature_of(model, block.thinking)
                content.append({"type": "thinking", "thinking": block.thinking, "signature": sig})
            elif isinstance(block, Redacted) and thinking:
                content.append(
                    {"type": "redacted_thinking", "data": redacted_data(model, block.hidden)}
                )
            elif isinstance(block, ToolUse):
                call = mint_id("toolu_01", number, len(content))
                content.append(
                    {"type": "tool_use", "id": call, "name": block.name, "input": block.input}
                )
        opaque = tuple(v for v in map(_opaque, content) if v)
        self._issued.update(dict.fromkeys(opaque, opaque))
        stop = script.stop_reason or (
            "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"
        )
        output = sum(
            estimate_tokens({k: v for k, v in b.items() if k != "signature"}) for b in content
        )
        return {
            "id": mint_id("msg_01", number), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": script.stop_sequence,
            "usage": {**usage, "output_tokens": max(1, output), "service_tier": "standard"},
        }  # fmt: skip


def _check_system(system: object) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise Refused("system: Input should be a valid list")
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise Refused(f"system.{i}.type: Input should be 'text'")
        for name in sorted(set(block) - {"type", "text", "cache_control", "citations"}):
            raise Refused(f"system.{i}.{name}: Extra inputs are not permitted")
        if not block.get("text"):
            raise Refused("system: text content blocks must be non-empty")


def _check_thinking(body: dict[str, Any]) -> bool:
    """Whether thinking is on; refuses settings the real API refuses."""
    thinking = body.get("thinking")
    if thinking is None or thinking.get("type") == "disabled":
        return False
    if thinking.get("type") == "adaptive":
        return True
    if thinking.get("type") != "enabled":
        raise Refused("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'")
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int):
        raise Refused("thinking.enabled.budget_tokens: Field required")
    if budget < 1024:
        raise Refused(
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
        )
    if "max_tokens" in body and body["max_tokens"] <= budget:
        raise Refused(
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
            f"documentation at {THINKING_DOCS}#max-tokens-and-context-window-size"
        )
    if body.get("temperature", 1) != 1:
        raise Refused(
            "`temperature` may only be set to 1 when thinking is enabled or in adaptive mode. "
            f"Please consult our documentation at {THINKING_DOCS}#feature-compatibility"
        )
    return True


def _turns(messages: object) -> list[_Turn]:
    """The messages as the model sees them: consecutive same-role messages are one turn."""
    if not isinstance(messages, list):
        raise Refused("messages: Input should be a valid list")
    if not messages:
        raise Refused("messages: at least one message is required")
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Refused(f"messages.{i}: Input should be a valid dictionary")
        for name in ("content", "role"):
            if name not in message:
                raise Refused(f"messages.{i}.{name}: Field required")
        for name in sorted(set(message) - {"role", "content"}):
            raise Refused(f"messages.{i}.{name}: Extra inputs are not permitted")
        role, content = message["role"], message["content"]
        if role not in ("user", "assistant"):
            raise Refused(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        last = i == len(messages) - 1
        if content == "" or content == []:
            if not (last and role == "assistant"):
                raise Refused(
                    f"messages.{i}: all messages must have non-empty content except for the "
                    "optional final assistant message"
                )
            continue
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
            raise Refused(f"messages.{i}.content: Input should be a valid list")
        blocks = [(f"messages.{i}.content.{j}", block) for j, block in enumerate(content)]
        if turns and turns[-1].role == role:
            turns[-1].blocks += blocks
        else:
            turns.append(_Turn(role, blocks, i))
    return turns


def _check_tool_pairs(turns: list[_Turn]) -> None:
    for n, turn in enumerate(turns):
        if turn.role != "user":
            continue
        asked = set()
        if n > 0:
            asked = {b["id"] for _, b in turns[n - 1].blocks if b.get("type") == "tool_use"}
        for path, block in turn.blocks:
            if block.get("type") == "tool_result" and block["tool_use_id"] not in asked:
                raise Refused(
                    f"{path}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{block['tool_use_id']}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
    for n, turn in enumerate(turns):
        calls = [b["id"] for _, b in turn.blocks if b.get("type") == "tool_use"]
        if turn.role != "assistant" or not calls:
            continue
        answered = set()
        if n + 1 < len(turns):
            for _, block in turns[n + 1].blocks:
                if block.get("type") != "tool_result":
                    break  # only the leading tool_result blocks answer
                answered.add(block["tool_use_id"])
        if missing := [call for call in calls if call not in answered]:
            raise Refused(
                f"messages.{turn.index}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message."
            )


def _check_final_thinking(turns: list[_Turn]) -> None:
    final = next((t for t in reversed(turns) if t.role == "assistant"), None)
    if final is None or not any(b.get("type") == "tool_use" for _, b in final.blocks):
        return
    path, first = final.blocks[0]
    if first.get("type") not in ("thinking", "redacted_thinking"):
        raise Refused(
            f"{path}.type: Expected `thinking` or `redacted_thinking`, but found "
            f"`{first.get('type')}`. When `thinking` is enabled, a final `assistant` message "
            "must start with a thinking block (preceeding the lastmost set of `tool_use` and "
            "`tool_result` blocks). We recommend you include thinking blocks from previous "
            "turns. To avoid this requirement, disable `thinking`. Please consult our "
            f"documentation at {THINKING_DOCS}"
        )


def _check_breakpoints(body: dict[str, Any]) -> None:
    found = sum("cache_control" in tool for tool in body.get("tools", []))
    if isinstance(body.get("system"), list):
        found += sum("cache_control" in block for block in body["system"])
    for message in body["messages"]:
        if isinstance(message["content"], list):
            found += sum("cache_control" in block for block in message["content"])
    found += body.get("cache_control") is not None
    if found > 4:
        raise Refused(f"A maximum of 4 blocks with cache_control may be provided. Found {found}.")


def _blocks(body: dict[str, Any], turns: list[_Turn]) -> list[dict[str, Any]]:
    """The prompt as the cache sees it: tools, system, the settings, each message block (with
    its role); a top-level ``cache_control`` marks the last block that may carry one."""
    system = body.get("system") or []
    blocks = [*body.get("tools", [])]
    blocks += [{"type": "text", "text": system}] if isinstance(system, str) else system
    settings = {"thinking": body.get("thinking"), "tool_choice": body.get("tool_choice")}
    blocks.append({"settings": settings})
    blocks += [{**block, "role": turn.role} for turn in turns for _, block in turn.blocks]
    if (automatic := body.get("cache_control")) is not None:
        marked = [i for i, b in enumerate(blocks) if not _opaque(b) and "settings" not in b]
        if marked:
            blocks[marked[-1]] = {**blocks[marked[-1]], "cache_control": automatic}
    return blocks


def _unmarked(block: dict[str, Any]) -> dict[str, Any]:
    """A block without its breakpoint: the marker is no part of the prompt."""
    return {k: v for k, v in block.items() if k != "cache_control"}


def _opaque(block: dict[str, Any]) -> str | None:
    if block.get("type") == "thinking":
        return str(block["signature"])
    if block.get("type") == "redacted_thinking":
        return str(block["data"])
    return None


def _token_id(value: str) -> bool:
    return bool(value) and all(c.isascii() and (c.isalnum() or c in "_-") for c in value)


def _json(status: int, payload: object, request_id: str, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=payload, headers={"request-id": request_id, **headers})


def _error(status: int, kind: str | None, message: str | None, request_id: str) -> httpx.Response:
    kind = kind or ERROR_TYPES.get(status, "api_error")
    body = {
        "type": "error",
        "error": {"type": kind, "message": message or ERROR_MESSAGES.get(kind, "error")},
        "request_id": request_id,
    }
    retry = "true" if status in (408, 409, 429) or status >= 500 else "false"
    return _json(status, body, request_id, **{"x-should-retry": retry})


def _scripted(script: Script, request_id: str) -> httpx.Response:
    if script.exception is not None:
        raise script.exception
    if script.raw_body is not None:
        return httpx.Response(script.http_status, content=script.raw_body, headers=script.headers)
    response = _error(script.http_status, script.error_type, script.message, request_id)
    retry_after = script.retry_after or ("30" if script.http_status == 429 else None)
    if retry_after is not None:
        response.headers["retry-after"] = retry_after
    response.headers.update(script.headers)
    return response


def _chunks(text: str, count: int) -> Iterator[str]:
    size = max(1, -(-len(text) // max(1, count)))
    for start in range(0, len(text), size):
        yield text[start : start + size]


def stream_events(message: dict[str, Any], script: Script) -> list[dict[str, Any]]:
    """The events of one streamed message, in the real order: ``message_start`` (empty
    content, ``stop_reason`` null, the input usage), per block ``content_block_start`` (a
    ``ping`` after the first), its deltas (a thinking block's ``signature_delta`` last) and
    ``content_block_stop``; ``message_delta`` (stop reason, cumulative usage) and
    ``message_stop``. A script's ``error_type`` ends the stream with an ``error`` event
    after the first block."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**usage, "output_tokens": 1}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        opening = {
            "text": {"type": "text", "text": ""},
            "thinking": {"type": "thinking", "thinking": "", "signature": ""},
            "tool_use": {**block, "input": {}},
        }.get(kind, block)
        events.append({"type": "content_block_start", "index": index, "content_block": opening})
        if index == 0:
            events.append({"type": "ping"})
        deltas: list[dict[str, Any]] = []
        if kind == "text":
            deltas = [
                {"type": "text_delta", "text": t} for t in _chunks(block["text"], script.deltas)
            ]
        elif kind == "thinking":
            deltas = [
                {"type": "thinking_delta", "thinking": t}
                for t in _chunks(block["thinking"], script.deltas)
            ]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            arguments = json.dumps(block["input"])
            deltas = [{"type": "input_json_delta", "partial_json": ""}]
            deltas += [
                {"type": "input_json_delta", "partial_json": t} for t in _chunks(arguments, 3)
            ]
        for delta in deltas:
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
        if script.error_type is not None:
            message_text = script.message or ERROR_MESSAGES.get(script.error_type, "error")
            error = {"type": script.error_type, "message": message_text}
            return [*events, {"type": "error", "error": error}]
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    cumulative = {k: usage[k] for k in ("input_tokens", "cache_creation_input_tokens",
                                        "cache_read_input_tokens", "output_tokens")}  # fmt: skip
    events.append({"type": "message_delta", "delta": delta, "usage": cumulative})
    events.append({"type": "message_stop"})
    return events


class _SSEStream(httpx.AsyncByteStream):
    """The events as server-sent events, one per chunk: ``event: <type>`` and ``data:``."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self._events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
