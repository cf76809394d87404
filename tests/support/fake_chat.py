"""A strict fake Chat Completions server behind ``httpx.MockTransport``, shaped like vLLM's
OpenAI-compatible server (``mode="vllm"``) or Ollama's (``mode="ollama"``): ``POST
{base}/chat/completions``, JSON or server-sent events, refusing what such a server refuses
with vLLM's error body ``{"error": {"message", "type", "param", "code"}}``.

Every call records its raw body, its decoded body and its headers; ``Script`` says how one call
answers. The wire format follows the official ``openai`` SDK's ``ChatCompletion`` and
``ChatCompletionChunk``: tests/unit/test_fake_chat_wire_format.py parses every answer with the
SDK under strict validation.

Shapes, as the servers send them:

- vLLM: ids ``chatcmpl-`` and 32 hex digits, tool call ids ``chatcmpl-tool-`` and 32 hex; a
  whole message ``{"role", "content", "refusal": null, "annotations": null, "audio": null,
  "function_call": null, "tool_calls" (when any), "reasoning_content"}`` (``reasoning_field``
  says which name: vLLM before 0.11 and DeepSeek ``reasoning_content``, later vLLM
  ``reasoning``); a stream opens with ``{"role": "assistant", "content": ""}``, sends
  thinking, text and each call's arguments in pieces (a call's first delta carries its
  ``index``, ``id``, ``type`` and name), a last choice delta with the ``finish_reason``, then
  with ``stream_options.include_usage`` a usage chunk with empty ``choices``, then ``[DONE]``.
- Ollama: ids ``chatcmpl-`` and a number, tool call ids ``call_`` and 8 characters, each
  with its ``index``; the thinking as ``reasoning``; no null fields; a stream sends each call
  whole in one delta.
- ``ids=False``: tool calls without ids (servers that give none).

What the fake checks (the first failure answers 400, or 404 for an unknown model / path):

- the path, a JSON object body, the key when one is configured (``Authorization: Bearer``,
  else 401); no unknown top-level field (current vLLM ignores one with a warning, as its
  ``extra="allow"`` does; this fake refuses it, as vLLM did before and as turnstore must not
  drop or invent fields); ``messages`` non-empty; the model.
- each message: its role and its allowed keys; a ``tool`` message needs ``tool_call_id``,
  which must answer a ``tool_calls`` entry of an earlier assistant message not yet answered.
- replay: an assistant message carrying thinking must be one this fake issued, for this
  model, exactly (JSON-equal, the thinking under the name it was issued with); an assistant
  message naming a tool call id this fake issued carries that call as issued.
- ``max_tokens`` (the reply is cut: ``finish_reason`` ``length``) and the context length:
  ``max_model_len`` tokens (``estimate_tokens``, UTF-8 bytes / 4), else vLLM's 400 "This
  model's maximum context length is ...".
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

API_KEY = "sk-chat-test"
BASE_URL = "https://chat.invalid/v1"
MODELS = ("qwen-test", "qwen-other")
TOP_LEVEL = {
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed",
    "stop", "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
    "reasoning_effort", "parallel_tool_calls", "user", "top_k", "min_p", "repetition_penalty",
    "chat_template_kwargs", "structured_outputs", "priority", "request_id",
}  # fmt: skip
MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {
        "role", "content", "name", "refusal", "annotations", "audio", "function_call",
        "tool_calls", "reasoning_content", "reasoning",
    },
    "tool": {"role", "content", "tool_call_id"},
}  # fmt: skip
EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    500: "InternalServerError",
}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class Script:
    content: str | None = None  # None: "reply <n>" (unless calls are scripted: no text)
    reasoning: str | None = None  # None: "thinking <n>"; "": no thinking
    calls: list[Call] = field(default_factory=list)
    finish_reason: str | None = None  # None: "tool_calls" with calls, else "stop"
    http_status: int = 200
    message: str | None = None  # an error's message
    retry_after: str | None = None  # of a 429 (default "7")
    deltas: int = 3  # streaming: thinking, text and arguments in this many pieces each
    raw_body: bytes | None = None
    stream_error: bool = False  # an error chunk in place of the finish
    exception: Exception | None = None  # raised by the transport


class Refused(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


JSON = {"content-type": "application/json"}


def _compact(value: object) -> bytes:
    """JSON as vLLM (pydantic) and Ollama (Go) write it: no spaces, non-ASCII as it is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def estimate_tokens(value: object) -> int:
    size = len(value.encode() if isinstance(value, str) else canonical(value))
    return max(1, math.ceil(size / 4))


def _pieces(text: str, count: int) -> list[str]:
    if not text:
        return []
    step = max(1, math.ceil(len(text) / max(1, count)))
    return [text[i : i + step] for i in range(0, len(text), step)]


@dataclass
class Issued:
    model: str
    message: dict[str, Any]
    raw: bytes  # as sent whole (non-streamed), or as a stream's message would be


class FakeChatServer:
    def __init__(
        self,
        *,
        mode: str = "vllm",
        reasoning_field: str | None = None,
        ids: bool = True,
        api_key: str | None = API_KEY,
        models: tuple[str, ...] = MODELS,
        max_model_len: int = 32768,
    ) -> None:
        self.mode = mode
        self.reasoning_field = reasoning_field or (
            "reasoning" if mode == "ollama" else "reasoning_content"
        )
        self.ids, self.api_key, self.models = ids, api_key, models
        self.max_model_len = max_model_len
        self.scripts: list[Script] = []
        self.requests: list[dict[str, Any]] = []  # accepted or not, decoded
        self.raw_bodies: list[bytes] = []
        self.headers: list[httpx.Headers] = []
        self.refusals: list[str] = []
        self.issued: list[Issued] = []
        self._calls: dict[str, dict[str, Any]] = {}  # tool call id -> the call as issued
        self._count = itertools.count(1)
        self._random = random.Random(7)

    def then(self, *scripts: Script) -> FakeChatServer:
        self.scripts.extend(scripts)
        return self

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    # -- the handler ---------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self.raw_bodies.append(body)
        self.headers.append(request.headers)
        try:
            decoded = self._checked(request, body)
        except Refused as refused:
            self.refusals.append(refused.message)
            return self._error(refused.status, refused.message, refused.param)
        script = self.scripts.pop(0) if self.scripts else Script()
        if script.exception is not None:
            raise script.exception
        if script.raw_body is not None:
            return httpx.Response(script.http_status, content=script.raw_body)
        if script.http_status != 200:
            headers = (
                {"retry-after": script.retry_after or "7"} if script.http_status == 429 else {}
            )
            message = script.message or "The server could not answer."
            return self._error(script.http_status, message, None, headers)
        n = next(self._count)
        reply = self._reply(decoded, script, n)
        if decoded.get("stream"):
            usage = bool((decoded.get("stream_options") or {}).get("include_usage"))
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=b"".join(self._stream(decoded["model"], reply, script, usage)),
            )
        return httpx.Response(
            200, content=_compact(self._whole(decoded["model"], reply)), headers=JSON
        )

    def _error(
        self, status: int, message: str, param: str | None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        kind = ERROR_TYPES.get(status, "RateLimitError" if status == 429 else "Error")
        error = {"message": message, "type": kind, "param": param, "code": status}
        return httpx.Response(
            status, content=_compact({"error": error}), headers={**JSON, **(headers or {})}
        )

    # -- checks --------------------------------------------------------------------------------

    def _checked(self, request: httpx.Request, body: bytes) -> dict[str, Any]:
        if request.url.path != "/v1/chat/completions" or request.method != "POST":
            raise Refused(f"Not Found: {request.url.path}", 404)
        if (
            self.api_key is not None
            and request.headers.get("authorization") != f"Bearer {self.api_key}"
        ):
            raise Refused("Unauthorized", 401)
        try:
            decoded = json.loads(body)
        except ValueError:
            raise Refused("Invalid JSON body.") from None
        self.requests.append(decoded)
        if not isinstance(decoded, dict):
            raise Refused("The body must be an object.")
        for name in decoded:
            if name not in TOP_LEVEL:
                raise Refused(f"Extra inputs are not permitted: {name}", param=name)
        if decoded.get("model") not in self.models:
            raise Refused(f"The model `{decoded.get('model')}` does not exist.", 404, "model")
        effort = decoded.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise Refused(f"Input should be one of {sorted(EFFORTS)}", param="reasoning_effort")
        messages = decoded.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused("messages must be a non-empty list", param="messages")
        self._check_messages(decoded["model"], messages)
        tokens = estimate_tokens(messages) + estimate_tokens(decoded.get("tools") or "")
        if tokens > self.max_model_len:
            raise Refused(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {tokens} tokens in the messages, Please reduce the length of the "
                "messages.",
                param="messages",
            )
        return decoded

    def _check_messages(self, model: str, messages: list[Any]) -> None:
        open_calls: set[str] = set()
        for index, message in enumerate(messages):
            where = f"messages.{index}"
            if not isinstance(message, dict) or message.get("role") not in MESSAGE_KEYS:
                raise Refused(f"{where}: unknown role", param="messages")
            role = message["role"]
            extra = set(message) - MESSAGE_KEYS[role]
            if extra:
                raise Refused(
                    f"{where}: Extra inputs are not permitted: {sorted(extra)[0]}", param="messages"
                )
            if role == "assistant":
                self._check_replayed(model, message, where)
                for call in message.get("tool_calls") or ():
                    if not isinstance(call, dict) or not call.get("id") or "function" not in call:
                        raise Refused(
                            f"{where}: a tool call needs its id and function", param="messages"
                        )
                    open_calls.add(call["id"])
            elif role == "tool":
                call_id = message.get("tool_call_id")
                if call_id not in open_calls:
                    raise Refused(
                        f"{where}: tool message {call_id!r} answers no earlier tool call",
                        param="messages",
                    )
                open_calls.discard(call_id)
            elif "content" not in message:
                raise Refused(f"{where}: content is required", param="messages")

    def _check_replayed(self, model: str, message: dict[str, Any], where: str) -> None:
        thinking = [name for name in ("reasoning_content", "reasoning") if message.get(name)]
        if thinking:
            same = [i for i in self.issued if self._plain(i.message) == self._plain(message)]
            if not same:
                raise Refused(
                    f"{where}: this assistant message's thinking was not issued as sent",
                    param="messages",
                )
            if all(i.model != model for i in same):
                raise Refused(f"{where}: thinking of another model", param="messages")
        for call in message.get("tool_calls") or ():
            issued = self._calls.get(call.get("id", "")) if isinstance(call, dict) else None
            if issued is not None and self._plain_call(call) != self._plain_call(issued):
                raise Refused(
                    f"{where}: tool call {call.get('id')!r} differs from the one issued",
                    param="messages",
                )

    def _plain_call(self, call: Any) -> Any:
        """A tool call less its ``index`` (a stream's, which Ollama also puts in whole
        messages), and less its id where this server gives none (its client had to make one)."""
        if not isinstance(call, dict):
            return call
        return {k: v for k, v in call.items() if k != "index" and (k != "id" or self.ids)}

    def _plain(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        return {**message, "tool_calls": [self._plain_call(c) for c in calls]} if calls else message

    # -- replies -------------------------------------------------------------------------------

    def _reply(self, request: dict[str, Any], script: Script, n: int) -> dict[str, Any]:
        content = script.content
        if content is None:
            content = "" if script.calls else f"reply {n}"
        reasoning = f"thinking {n}" if script.reasoning is None else script.reasoning
        finish = script.finish_reason or ("tool_calls" if script.calls else "stop")
        limit = request.get("max_tokens")
        if isinstance(limit, int) and estimate_tokens(content) > limit:
            content, finish = content[: limit * 4], "length"
        calls = [self._call(call, i) for i, call in enumerate(script.calls)]
        prompt = estimate_tokens(request["messages"])
        out = estimate_tokens(content) + (estimate_tokens(reasoning) if reasoning else 0)
        return {
            "id": self._completion_id(),
            "content": content,
            "reasoning": reasoning,
            "calls": calls,
            "finish": finish,
            "usage": {"prompt_tokens": prompt, "completion_tokens": out},
        }

    def _completion_id(self) -> str:
        if self.mode == "ollama":
            return f"chatcmpl-{self._random.randrange(1000)}"
        return f"chatcmpl-{os.urandom(16).hex()}"

    def _call(self, call: Call, index: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.ids:
            if self.mode == "ollama":
                letters = string.ascii_lowercase + string.digits
                out["id"] = "call_" + "".join(self._random.choice(letters) for _ in range(8))
            else:
                out["id"] = f"chatcmpl-tool-{os.urandom(16).hex()}"
        if self.mode == "ollama":
            out["index"] = index
        out["type"] = "function"
        out["function"] = {"name": call.name, "arguments": json.dumps(call.arguments)}
        return out

    def _message(self, reply: dict[str, Any], *, whole: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
        if self.mode == "vllm" and whole:
            message |= {"refusal": None, "annotations": None, "audio": None, "function_call": None}
        if reply["calls"]:
            message["tool_calls"] = reply["calls"]
        if reply["reasoning"]:
            message[self.reasoning_field] = reply["reasoning"]
        return message

    def _issue(self, model: str, message: dict[str, Any], raw: bytes) -> None:
        self.issued.append(Issued(model, message, raw))
        for call in message.get("tool_calls") or ():
            if call.get("id"):
                self._calls[call["id"]] = call

    def _whole(self, model: str, reply: dict[str, Any]) -> dict[str, Any]:
        message = self._message(reply, whole=True)
        self._issue(model, message, _compact(message))
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = reply["finish"]
        if self.mode == "vllm":
            choice["stop_reason"] = None
        return {
            "id": reply["id"],
            "object": "chat.completion",
            "created": 1_760_000_000,
            "model": model,
            "choices": [choice],
            "usage": self._usage(reply),
            **({"system_fingerprint": "fp_ollama"} if self.mode == "ollama" else {}),
        }

    def _usage(self, reply: dict[str, Any]) -> dict[str, Any]:
        usage = dict(reply["usage"])
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self.mode == "vllm":
            usage["prompt_tokens_details"] = {"cached_tokens": usage["prompt_tokens"] // 2}
        return usage

    def _stream(
        self, model: str, reply: dict[str, Any], script: Script, usage: bool
    ) -> Iterator[bytes]:
        def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
            choices = (
                []
                if delta is None
                else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            )
            data = {
                "id": reply["id"],
                "object": "chat.completion.chunk",
                "created": 1_760_000_000,
                "model": model,
                "choices": choices,
                **extra,
            }
            return b"data: " + _compact(data) + b"\n\n"

        # What the stream's message is, as the adapter should rebuild it (no null extras).
        streamed = self._message(reply, whole=False)
        self._issue(model, streamed, _compact(streamed))
        yield chunk({"role": "assistant", "content": ""})
        for piece in _pieces(reply["reasoning"] or "", script.deltas):
            yield chunk({self.reasoning_field: piece})
        for piece in _pieces(reply["content"], script.deltas):
            yield chunk({"content": piece})
        for index, call in enumerate(reply["calls"]):
            if self.mode == "ollama":
                yield chunk({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            first = {
                "index": index,
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            if "id" in call:
                first["id"] = call["id"]
            yield chunk({"tool_calls": [first]})
            for piece in _pieces(call["function"]["arguments"], script.deltas):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        if script.stream_error:
            error = {
                "message": script.message or "internal error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
            yield b"data: " + _compact({"error": error}) + b"\n\n"
            return
        yield chunk({"content": ""} if self.mode == "ollama" else {}, reply["finish"])
        if usage:
            yield chunk(None, usage=self._usage(reply))
        yield b"data: [DONE]\n\n"
