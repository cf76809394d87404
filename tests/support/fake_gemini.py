"""A strict fake Gemini API behind ``httpx.MockTransport``: ``POST
/v1beta/models/{model}:generateContent``, ``:streamGenerateContent?alt=sse`` and
``:countTokens``, as the real API shapes them (a whole reply pretty-printed, as Google's JSON
is; a stream as server-sent events, one ``GenerateContentResponse`` each), refusing what the
real API refuses with Google's error body (``{"error": {"code", "message", "status"}}``).

Every call records the decoded request body, its headers and URL; ``Script`` says how one call
answers (the parts of the reply, its ``finishReason``, a blocked prompt, an HTTP error). The
wire format follows the official ``google-genai`` SDK's types:
``tests/unit/test_fake_gemini_wire_format.py`` parses every answer with the SDK.

What the fake checks, in this order (the first failure answers):

- the key (``x-goog-api-key`` or ``?key=``: missing ``403 PERMISSION_DENIED``, wrong ``400
  INVALID_ARGUMENT``), the path and method (else ``404 NOT_FOUND``), ``alt=sse`` on a stream,
  the model (unknown: ``404 NOT_FOUND``). A scripted HTTP error or transport exception answers
  next; a refused request does not use up a script.
- the body: no unknown field anywhere it is checked (``Unknown name "x"``), ``contents`` a
  non-empty list of contents of role ``user`` or ``model`` with non-empty ``parts``, each part
  with exactly one data field (text, inlineData, fileData, functionCall, functionResponse...)
  and only Gemini's other part fields; ``functionCall`` and ``functionResponse`` with their
  required fields; ``generationConfig`` and its ``thinkingConfig`` (a level on Gemini 3 only,
  never with a budget), ``responseJsonSchema`` only with ``responseMimeType``
  ``application/json``; tools as ``functionDeclarations``; ``toolConfig``'s mode.
- signatures: a part's ``thoughtSignature`` is ``signature_of(model, part)``, a keyed digest of
  the model and the part's content without its signature (key order and whitespace do not
  matter): altered, moved to another part or replayed to another model it is "Corrupted
  thought signature." The placeholders Gemini documents for calls it never issued pass. On a
  Gemini 3 model, the first ``functionCall`` of each model content without a signature is
  "Function call is missing a thought_signature in functionCall parts...".
- function responses: after a model content with calls comes a user content with as many
  ``functionResponse`` parts, each naming a call (and its ``id`` where the call has one), and a
  response follows only a content with calls.
- the prompt's size: "The input token count (N) exceeds the maximum number of tokens allowed
  (M)."; tokens are ``estimate_tokens`` (UTF-8 bytes of canonical JSON / 4, rounded up).
- implicit caching: per model, a request reads back the longest prefix of its prompt (system
  instruction, tools, then each content's parts with their role) that an earlier request
  had, of at least ``min_cache_tokens`` tokens, as ``cachedContentTokenCount``.

A reply signs as Gemini 3 does: its first ``functionCall``, or (without calls) its last part,
and thought parts (only with ``includeThoughts``); Gemini 2.5 signs its first call only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import re
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.fake_anthropic import Refused, canonical, estimate_tokens

SECRET = b"fake-gemini-signing-key"
API_KEY = "AIzaSyFake-gemini-test-key-0123456789"
MODELS = ("gemini-3-test", "gemini-3-other", "gemini-2.5-test")
PLACEHOLDERS = ("skip_thought_signature_validator", "context_engineering_is_the_way_to_go")
SIGNATURES_DOCS = "https://ai.google.dev/gemini-api/docs/thought-signatures"
TOP_LEVEL = {
    "contents", "systemInstruction", "tools", "toolConfig", "safetySettings",
    "generationConfig", "cachedContent",
}  # fmt: skip
DATA = ("text", "inlineData", "fileData", "functionCall", "functionResponse", "executableCode")
DATA += ("codeExecutionResult",)
PART_FIELDS = {*DATA, "thought", "thoughtSignature", "videoMetadata", "partMetadata"}
PART_FIELDS |= {"mediaResolution"}
GENERATION = {
    "temperature", "topP", "topK", "maxOutputTokens", "candidateCount", "stopSequences",
    "responseMimeType", "responseSchema", "responseJsonSchema", "thinkingConfig", "seed",
    "presencePenalty", "frequencyPenalty", "responseModalities", "responseLogprobs",
}  # fmt: skip
LEVELS = ("minimal", "low", "medium", "high")
ERROR_STATUS = {
    400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip
ERROR_MESSAGES = {
    "RESOURCE_EXHAUSTED": "You exceeded your current quota, please check your plan and "
    "billing details.",
    "INTERNAL": "An internal error has occurred. Please retry or report in "
    "https://developers.generativeai.google/guide/troubleshooting",
    "UNAVAILABLE": "The model is overloaded. Please try again later.",
    "DEADLINE_EXCEEDED": "Deadline expired before operation could complete.",
}


# Reply parts a script is made of.
@dataclass(frozen=True)
class Text:
    text: str
    signed: bool | None = None  # None: as the model signs (module docstring)


@dataclass(frozen=True)
class Thought:
    text: str
    signed: bool = True


@dataclass(frozen=True)
class Call:
    name: str
    args: dict[str, Any] = field(default_factory=dict)


Part = Text | Thought | Call


@dataclass
class Script:
    parts: list[Part] | None = None  # None: a thought (when asked for), "reply <n>"
    finish_reason: str = "STOP"
    block_reason: str | None = None  # a blocked prompt: no candidates, promptFeedback only
    http_status: int = 200
    status: str | None = None  # of a non-2xx body (default: the HTTP status's), or mid-stream
    message: str | None = None
    retry_after: str | None = None  # a Retry-After header (Gemini sends RetryInfo instead)
    retry_delay: str | None = None  # RetryInfo's retryDelay (429 default: "7s")
    deltas: int = 3  # streaming: text and thought come in this many chunks each
    signature_first: bool = False  # streaming: a text's signature on its first chunk
    stream_error: bool = False  # streaming: an error chunk after the first part
    raw_body: bytes | None = None
    exception: Exception | None = None  # raised by the transport, e.g. httpx.ReadTimeout


def _mac(*parts: str | bytes) -> bytes:
    data = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(SECRET, data, hashlib.sha256).digest()


def _unsigned(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if k != "thoughtSignature"}


def signature_of(model: str, part: dict[str, Any]) -> str:
    """A part's signature: keyed digests of the model and the part's exact content."""
    content = canonical(_unsigned(part))
    return base64.b64encode(b"\x12\x30" + _mac("sig", model, content) + _mac("x", content)).decode()


def signs_calls(model: str) -> bool:
    return model.startswith("gemini-3")


@dataclass
class _Turn:
    role: str
    parts: list[tuple[str, dict[str, Any]]]  # (path, part)


class FakeGeminiAPI:
    def __init__(
        self,
        *,
        models: tuple[str, ...] = MODELS,
        api_key: str = API_KEY,
        context_tokens: int = 1_048_576,
        min_cache_tokens: int = 1024,
        call_ids: bool = False,  # whether replies give their calls ids (Gemini mostly does not)
    ) -> None:
        self.models, self.api_key = models, api_key
        self.context_tokens, self.min_cache_tokens = context_tokens, min_cache_tokens
        self.call_ids = call_ids
        self.requests: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.urls: list[str] = []
        self.issued: list[dict[str, Any]] = []  # every part replied, in order
        self.refusals: list[str] = []  # the message of each refused request
        self._scripts: deque[Script] = deque()
        self._numbers = itertools.count(1)
        self._cache: set[tuple[str, str]] = set()  # (model, prefix digest)

    def then(self, *scripts: Script) -> FakeGeminiAPI:
        self._scripts.extend(scripts)
        return self

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.headers.append(request.headers)
        self.urls.append(str(request.url))
        number = next(self._numbers)
        try:
            model, method, parsed = self._accept(request, body)
            parsed = _normal(parsed)
            if method == "countTokens":
                inner = self._counted(parsed, model)
                return _json(200, {"totalTokens": inner})
            script = self._scripts[0] if self._scripts else Script()
            if script.exception is not None or script.http_status != 200 or script.raw_body:
                self._scripts.popleft() if self._scripts else None
                return _scripted(script)
            tokens = self._check(parsed, model)
        except Refused as refused:
            self.refusals.append(refused.message)
            return _error(refused.status, None, refused.message)
        if self._scripts:
            self._scripts.popleft()
        cached = self._cached(parsed, model, tokens)
        reply = self._reply(number, model, parsed, script, sum(tokens), cached)
        if method == "generateContent":
            return httpx.Response(
                200,
                content=json.dumps(reply, indent=2).encode(),  # as Google's JSON comes
                headers={"content-type": "application/json; charset=UTF-8"},
            )
        chunks = stream_chunks(reply, script)
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_SSEStream(chunks))

    # -- the request -------------------------------------------------------------------------

    def _accept(self, request: httpx.Request, body: bytes) -> tuple[str, str, dict[str, Any]]:
        key = request.headers.get("x-goog-api-key") or request.url.params.get("key")
        if key is None:
            raise Refused(
                "Method doesn't allow unregistered callers (callers without established "
                "identity). Please use API Key or other form of API consumer identity to call "
                "this API.",
                403,
            )
        if key != self.api_key:
            raise Refused("API key not valid. Please pass a valid API key.")
        found = re.fullmatch(r"/v1beta/models/([^/:]+):(\w+)", request.url.path)
        if request.method != "POST" or found is None:
            raise Refused(f"Not found: {request.method} {request.url.path}", 404)
        model, method = found.groups()
        if method not in ("generateContent", "streamGenerateContent", "countTokens"):
            raise Refused(f"Method not found: {method}", 404)
        if method == "streamGenerateContent" and request.url.params.get("alt") != "sse":
            raise Refused("This fake streams server-sent events only: add alt=sse", 404)
        if model not in self.models:
            raise Refused(
                f"models/{model} is not found for API version v1beta, or is not supported for "
                f"{method}. Call ListModels to see the list of available models and their "
                "supported methods.",
                404,
            )
        try:
            parsed = json.loads(body)
        except ValueError:
            raise Refused("Invalid JSON payload received. Unexpected token.") from None
        if not isinstance(parsed, dict):
            raise Refused("Invalid JSON payload received. Expected an object.")
        self.requests.append(parsed)
        return model, method, parsed

    def _counted(self, body: dict[str, Any], model: str) -> int:
        _unknown(body, {"contents", "generateContentRequest"}, "")
        inner = body.get("generateContentRequest")
        if inner is None:
            return sum(self._check({"contents": body.get("contents")}, model))
        if not isinstance(inner, dict) or inner.get("model") != f"models/{model}":
            raise Refused("generateContentRequest.model must name the model counted.")
        return sum(self._check({k: v for k, v in inner.items() if k != "model"}, model))

    def _check(self, body: dict[str, Any], model: str) -> list[int]:
        """Every refusal the body earns, first found first; else the prompt's blocks' tokens
        (as ``_blocks`` lists them)."""
        _unknown(body, TOP_LEVEL, "")
        _check_system(body.get("systemInstruction"))
        _check_tools(body.get("tools"), body.get("toolConfig"))
        _check_generation(body.get("generationConfig"), model)
        turns = _turns(body.get("contents"))
        for turn in turns:
            for path, part in turn.parts:
                _check_part(path, part, model)
        if signs_calls(model):
            _check_call_signatures(turns)
        _check_responses(turns)
        tokens = [estimate_tokens(block) for block in _blocks(body, turns)]
        if sum(tokens) > self.context_tokens:
            raise Refused(
                f"The input token count ({sum(tokens)}) exceeds the maximum number of tokens "
                f"allowed ({self.context_tokens})."
            )
        return tokens

    def _cached(self, body: dict[str, Any], model: str, tokens: list[int]) -> int:
        """The longest prefix of this prompt an earlier request had (implicit caching)."""
        running = hashlib.sha256(model.encode())
        digests, totals = [], []
        for block, count in zip(_blocks(body, _turns(body["contents"])), tokens, strict=True):
            running.update(canonical(block))
            digests.append(running.hexdigest())
            totals.append((totals[-1] if totals else 0) + count)
        read = 0
        for digest, total in zip(digests, totals, strict=True):
            if (model, digest) in self._cache:
                read = total
        for digest, total in zip(digests, totals, strict=True):
            if total >= self.min_cache_tokens:
                self._cache.add((model, digest))
        return read if read >= self.min_cache_tokens else 0

    # -- the answer --------------------------------------------------------------------------

    def _reply(
        self,
        number: int,
        model: str,
        body: dict[str, Any],
        script: Script,
        prompt: int,
        cached: int,
    ) -> dict[str, Any]:
        usage: dict[str, Any] = {"promptTokenCount": prompt}
        if cached:
            usage["cachedContentTokenCount"] = cached
        response_id = base64.urlsafe_b64encode(_mac("id", str(number))[:16]).decode().rstrip("=")
        if script.block_reason is not None:
            usage["totalTokenCount"] = prompt
            return {
                "promptFeedback": {"blockReason": script.block_reason},
                "usageMetadata": usage,
                "modelVersion": model,
                "responseId": response_id,
            }
        thinking = (body.get("generationConfig") or {}).get("thinkingConfig") or {}
        thoughts_shown = bool(thinking.get("includeThoughts"))
        scripted = script.parts
        if scripted is None:
            scripted = [Thought(f"thinking {number}"), Text(f"reply {number}")]
        parts = self._parts(number, model, scripted, thoughts_shown)
        thinks = signs_calls(model) or thinking.get("thinkingBudget", 1) != 0
        thought_tokens = sum(estimate_tokens(p["text"]) for p in parts if p.get("thought"))
        thought_tokens += 16 if thinks else 0
        candidates = sum(estimate_tokens(_unsigned(p)) for p in parts if not p.get("thought"))
        usage["candidatesTokenCount"] = candidates
        usage["totalTokenCount"] = prompt + candidates + thought_tokens
        if thought_tokens:
            usage["thoughtsTokenCount"] = thought_tokens
        usage["promptTokensDetails"] = [{"modality": "TEXT", "tokenCount": prompt}]
        candidate = {
            "content": {"parts": parts, "role": "model"},
            "finishReason": script.finish_reason,
            "index": 0,
        }
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": model,
            "responseId": response_id,
        }

    def _parts(
        self, number: int, model: str, scripted: list[Part], thoughts_shown: bool
    ) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        signed: list[bool] = []
        for n, item in enumerate(scripted):
            if isinstance(item, Thought):
                if thoughts_shown:
                    parts.append({"text": item.text, "thought": True})
                    signed.append(item.signed)
            elif isinstance(item, Text):
                parts.append({"text": item.text})
                signed.append(bool(item.signed))
            else:
                call: dict[str, Any] = {"name": item.name, "args": item.args}
                if self.call_ids:
                    call["id"] = base64.b32encode(_mac("call", str(number), str(n))[:5]).decode()
                parts.append({"functionCall": call})
                signed.append(False)
        calls = [i for i, p in enumerate(parts) if "functionCall" in p]
        if calls:
            signed[calls[0]] = True  # each step's first call carries the signature
        elif signs_calls(model):
            last = [i for i, p in enumerate(parts) if not p.get("thought")]
            if last and not any(isinstance(s, Text) and s.signed is False for s in scripted):
                signed[last[-1]] = True
        for part, sign in zip(parts, signed, strict=True):
            if sign:
                part["thoughtSignature"] = signature_of(model, part)
        self.issued += parts
        return parts


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.title() for word in rest)


def _fields(value: Any, *nested: str) -> Any:
    """A message's field names as lowerCamel (the API takes its protos' names either way, as
    the SDK mixes them), and so the named nested messages' (never a Struct's keys: args,
    a response, a schema)."""
    if not isinstance(value, dict):
        return value
    out = {_camel(name): item for name, item in value.items()}
    for name in nested:
        if isinstance(out.get(name), dict):
            out[name] = _fields(out[name])
    return out


def _unknown(value: dict[str, Any], allowed: set[str], where: str) -> None:
    for name in sorted(set(value) - allowed):
        at = f" at '{where}'" if where else ""
        raise Refused(
            f'Invalid JSON payload received. Unknown name "{name}"{at}: Cannot find field.'
        )


def _check_system(system: object) -> None:
    if system is None:
        return
    if not isinstance(system, dict) or not isinstance(system.get("parts"), list):
        raise Refused("* GenerateContentRequest.system_instruction.parts: must be a list")
    _unknown(system, {"parts", "role"}, "system_instruction")
    for i, part in enumerate(system["parts"]):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise Refused(f"* GenerateContentRequest.system_instruction.parts[{i}]: text only")


def _check_tools(tools: object, config: object) -> None:
    if tools is not None:
        if not isinstance(tools, list):
            raise Refused("* GenerateContentRequest.tools: must be a list")
        for i, tool in enumerate(tools):
            _unknown(tool, {"functionDeclarations", "googleSearch", "codeExecution"}, f"tools[{i}]")
            for j, declared in enumerate(tool.get("functionDeclarations", [])):
                where = f"tools[{i}].function_declarations[{j}]"
                _unknown(
                    declared,
                    {"name", "description", "parameters", "parametersJsonSchema", "response"},
                    where,
                )
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}", declared.get("name", "")):
                    raise Refused(f"* GenerateContentRequest.{where}.name: Invalid function name.")
    if config is not None:
        _unknown(config, {"functionCallingConfig"}, "tool_config")
        calling = config.get("functionCallingConfig", {})
        _unknown(calling, {"mode", "allowedFunctionNames"}, "tool_config.function_calling_config")
        if calling.get("mode", "AUTO") not in ("AUTO", "ANY", "NONE", "VALIDATED"):
            raise Refused(
                "Invalid value at 'tool_config.function_calling_config.mode' (type.googleapis."
                f'com/google.ai.generativelanguage.v1beta.FunctionCallingConfig.Mode), "{calling["mode"]}"'
            )


def _check_generation(config: object, model: str) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise Refused("* GenerateContentRequest.generation_config: must be an object")
    _unknown(config, GENERATION, "generation_config")
    if not 0 <= config.get("temperature", 1) <= 2:
        raise Refused("* GenerateContentRequest.generation_config.temperature: must be in [0, 2]")
    if not 0 <= config.get("topP", 1) <= 1:
        raise Refused("* GenerateContentRequest.generation_config.top_p: must be in [0, 1]")
    if config.get("maxOutputTokens", 1) < 1:
        raise Refused("* GenerateContentRequest.generation_config.max_output_tokens: must be >= 1")
    if "responseJsonSchema" in config and config.get("responseMimeType") != "application/json":
        raise Refused(
            "* GenerateContentRequest.generation_config.response_mime_type: "
            "responseJsonSchema needs response_mime_type application/json"
        )
    thinking = config.get("thinkingConfig")
    if thinking is None:
        return
    _unknown(thinking, {"thinkingBudget", "thinkingLevel", "includeThoughts"}, "thinking_config")
    if "thinkingBudget" in thinking and "thinkingLevel" in thinking:
        raise Refused("You can only set only one of thinking budget and thinking level.")
    level = thinking.get("thinkingLevel")
    if level is not None and not signs_calls(model):
        raise Refused("Thinking level is not supported for this model.")
    if level is not None and str(level).lower() not in LEVELS:
        raise Refused(
            f"Invalid value at 'generation_config.thinking_config.thinking_level', \"{level}\""
        )


def _turns(contents: object) -> list[_Turn]:
    """The contents as the model sees them: consecutive same-role contents are one turn."""
    if not isinstance(contents, list) or not contents:
        raise Refused("* GenerateContentRequest.contents: contents is not specified")
    turns: list[_Turn] = []
    for i, content in enumerate(contents):
        if not isinstance(content, dict):
            raise Refused(f"* GenerateContentRequest.contents[{i}]: must be an object")
        _unknown(content, {"role", "parts"}, f"contents[{i}]")
        role = content.get("role", "user")
        if role not in ("user", "model"):
            raise Refused(f"Please use a valid role: user, model. (contents[{i}].role: {role!r})")
        parts = content.get("parts")
        if not isinstance(parts, list) or not parts:
            raise Refused(
                f"* GenerateContentRequest.contents[{i}].parts: contents.parts must not be empty."
            )
        placed = [(f"contents[{i}].parts[{j}]", part) for j, part in enumerate(parts)]
        if turns and turns[-1].role == role:
            turns[-1].parts += placed
        else:
            turns.append(_Turn(role, placed))
    return turns


def _check_part(path: str, part: object, model: str) -> None:
    if not isinstance(part, dict):
        raise Refused(f"* GenerateContentRequest.{path}: must be an object")
    _unknown(part, PART_FIELDS, path)
    data = [name for name in DATA if name in part]
    if len(data) != 1:
        raise Refused(
            f"* GenerateContentRequest.{path}.data: required oneof field 'data' must have one "
            "initialized field"
        )
    if "text" in part and not isinstance(part["text"], str):
        raise Refused(f"Invalid value at '{path}.text' (TYPE_STRING)")
    call = part.get("functionCall")
    if call is not None:
        _unknown(call, {"id", "name", "args"}, f"{path}.function_call")
        if not isinstance(call.get("name"), str) or not call["name"]:
            raise Refused(f"* GenerateContentRequest.{path}.function_call.name: Name is empty.")
        if not isinstance(call.get("args", {}), dict):
            raise Refused(
                f"Invalid value at '{path}.function_call.args' (type.googleapis.com/google.protobuf.Struct)"
            )
    response = part.get("functionResponse")
    if response is not None:
        allowed = {"id", "name", "response", "willContinue", "scheduling", "parts"}
        _unknown(response, allowed, f"{path}.function_response")
        if not isinstance(response.get("name"), str) or not response["name"]:
            raise Refused(f"* GenerateContentRequest.{path}.function_response.name: Name is empty.")
        if not isinstance(response.get("response"), dict):
            raise Refused(f"* GenerateContentRequest.{path}.function_response.response: required")
    if "inlineData" in part:
        _unknown(part["inlineData"], {"mimeType", "data", "displayName"}, f"{path}.inline_data")
        if not part["inlineData"].get("mimeType") or not part["inlineData"].get("data"):
            raise Refused(f"* GenerateContentRequest.{path}.inline_data: mime_type and data")
    if "fileData" in part:
        _unknown(part["fileData"], {"mimeType", "fileUri", "displayName"}, f"{path}.file_data")
        if not part["fileData"].get("fileUri"):
            raise Refused(f"* GenerateContentRequest.{path}.file_data.file_uri: required")
    signature = part.get("thoughtSignature")
    if signature is None or signature in PLACEHOLDERS:
        return
    try:  # bytes in proto JSON: base64, standard or URL-safe, padded or not
        sent = base64.b64decode(
            signature.translate(_URL_SAFE) + "=" * (-len(signature) % 4), validate=True
        )
    except (ValueError, TypeError, AttributeError):
        raise Refused(
            f"Invalid value at '{path}.thought_signature' (TYPE_BYTES), Base64 decoding failed "
            f'for "{str(signature)[:20]}"'
        ) from None
    if not hmac.compare_digest(sent, base64.b64decode(signature_of(model, part))):
        raise Refused("Corrupted thought signature.")


_URL_SAFE = str.maketrans("-_", "+/")


def _check_call_signatures(turns: list[_Turn]) -> None:
    for turn in turns:
        calls = [(path, p) for path, p in turn.parts if "functionCall" in p]
        if turn.role == "model" and calls and "thoughtSignature" not in calls[0][1]:
            path, part = calls[0]
            position = int(re.findall(r"\d+", path)[0]) + 1
            raise Refused(
                "Function call is missing a thought_signature in functionCall parts. This is "
                "required for tools to work correctly, and missing thought_signature may lead to "
                "degraded model performance. Additional data, function call `default_api:"
                f"{part['functionCall']['name']}` , position {position}. Please refer to "
                f"{SIGNATURES_DOCS} for more details."
            )


def _check_responses(turns: list[_Turn]) -> None:
    for n, turn in enumerate(turns):
        answers = [p["functionResponse"] for _, p in turn.parts if "functionResponse" in p]
        before = turns[n - 1] if n else None
        calls = (
            [p["functionCall"] for _, p in before.parts if "functionCall" in p] if before else []
        )
        if answers and not calls:
            raise Refused(
                "Please ensure that function response turn comes immediately after a function "
                "call turn."
            )
        if turn.role == "model":
            calls_here = [p for _, p in turn.parts if "functionCall" in p]
            following = turns[n + 1] if n + 1 < len(turns) else None
            if calls_here and following is not None:
                got = [p for _, p in following.parts if "functionResponse" in p]
                if len(got) != len(calls_here):
                    raise Refused(
                        "Please ensure that the number of function response parts is equal to "
                        "the number of function call parts of the function call turn."
                    )
        if not answers:
            continue
        for answer in answers:
            named = [c for c in calls if c["name"] == answer["name"]]
            if not named:
                raise Refused(
                    f"Function response {answer['name']!r} answers no function call of the "
                    "turn before it."
                )
            ids = {c.get("id") for c in calls}
            if answer.get("id") is not None and answer["id"] not in ids:
                raise Refused(f"Function response id {answer['id']!r} matches no function call.")
            if all(c.get("id") for c in named) and answer.get("id") is None:
                raise Refused(f"Function response {answer['name']!r} needs its call's id.")


def _normal(body: dict[str, Any]) -> dict[str, Any]:
    """A request with every proto field name lowerCamel (``_fields``)."""
    body = _fields(body, "systemInstruction", "toolConfig", "generationConfig")
    if isinstance(body.get("generateContentRequest"), dict):
        body["generateContentRequest"] = _normal(body["generateContentRequest"])
    if isinstance(body.get("toolConfig"), dict):
        body["toolConfig"] = _fields(body["toolConfig"], "functionCallingConfig")
    if isinstance(body.get("generationConfig"), dict):
        body["generationConfig"] = _fields(body["generationConfig"], "thinkingConfig")
    if isinstance(body.get("tools"), list):
        body["tools"] = [_tool(tool) for tool in body["tools"]]
    if isinstance(body.get("contents"), list):
        body["contents"] = [_content(content) for content in body["contents"]]
    return body


def _tool(tool: Any) -> Any:
    tool = _fields(tool)
    if isinstance(tool, dict) and isinstance(tool.get("functionDeclarations"), list):
        tool["functionDeclarations"] = [_fields(d) for d in tool["functionDeclarations"]]
    return tool


def _content(content: Any) -> Any:
    content = _fields(content)
    if isinstance(content, dict) and isinstance(content.get("parts"), list):
        nested = ("functionCall", "functionResponse", "inlineData", "fileData")
        content["parts"] = [_fields(part, *nested) for part in content["parts"]]
    return content


def _blocks(body: dict[str, Any], turns: list[_Turn]) -> list[Any]:
    """The prompt as the cache sees it: the system instruction, the tools, each part with its
    role."""
    blocks: list[Any] = [{"system": body.get("systemInstruction")}, {"tools": body.get("tools")}]
    blocks += [{"role": turn.role, **part} for turn in turns for _, part in turn.parts]
    return blocks


def _json(status: int, payload: object, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=payload, headers=headers)


def _error(
    status: int, kind: str | None, message: str | None, details: list[Any] | None = None
) -> httpx.Response:
    kind = kind or ERROR_STATUS.get(status, "UNKNOWN")
    error: dict[str, Any] = {
        "code": status,
        "message": message or ERROR_MESSAGES.get(kind, "error"),
        "status": kind,
    }
    if details:
        error["details"] = details
    return httpx.Response(
        status,
        content=json.dumps({"error": error}, indent=2).encode(),
        headers={"content-type": "application/json; charset=UTF-8"},
    )


def _retry_info(delay: str) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}


def _scripted(script: Script) -> httpx.Response:
    if script.exception is not None:
        raise script.exception
    if script.raw_body is not None:
        return httpx.Response(script.http_status, content=script.raw_body)
    details = None
    if script.http_status == 429:
        details = [_retry_info(script.retry_delay or "7s")]
    response = _error(script.http_status, script.status, script.message, details)
    if script.retry_after is not None:
        response.headers["retry-after"] = script.retry_after
    return response


def _pieces(text: str, count: int) -> list[str]:
    size = max(1, -(-len(text) // max(1, count)))
    return [text[start : start + size] for start in range(0, len(text), size)] or [""]


def stream_chunks(reply: dict[str, Any], script: Script) -> list[dict[str, Any]]:
    """The chunks of one streamed reply, as Gemini streams: each a GenerateContentResponse
    with the parts it adds; text and thought in ``deltas`` pieces, a signed one's signature on
    an empty text after them (or on its first piece, ``signature_first``); a call whole; the
    last chunk with ``finishReason`` and the whole usage (earlier ones the prompt's)."""
    head = {"modelVersion": reply["modelVersion"], "responseId": reply["responseId"]}
    if "candidates" not in reply:
        return [reply]
    usage = reply["usageMetadata"]
    early = {
        "promptTokenCount": usage["promptTokenCount"],
        "totalTokenCount": usage["promptTokenCount"],
    }
    pieces: list[dict[str, Any]] = []
    for part in reply["candidates"][0]["content"]["parts"]:
        if "text" not in part:
            pieces.append(part)
            continue
        flag = {"thought": True} if part.get("thought") else {}
        texts = _pieces(part["text"], script.deltas)
        signature = part.get("thoughtSignature")
        for n, text in enumerate(texts):
            piece = {"text": text, **flag}
            if signature is not None and script.signature_first and n == 0:
                piece["thoughtSignature"] = signature
            pieces.append(piece)
        if signature is not None and not script.signature_first:
            pieces.append({"text": "", **flag, "thoughtSignature": signature})
    chunks = []
    for n, piece in enumerate(pieces):
        candidate: dict[str, Any] = {"content": {"parts": [piece], "role": "model"}, "index": 0}
        last = n == len(pieces) - 1
        if last:
            candidate["finishReason"] = reply["candidates"][0]["finishReason"]
        chunks.append(
            {"candidates": [candidate], "usageMetadata": usage if last else early, **head}
        )
        if script.stream_error and n == 0:
            error = {"code": 500, "message": ERROR_MESSAGES["INTERNAL"], "status": "INTERNAL"}
            return [*chunks, {"error": error}]
    return chunks


class _SSEStream(httpx.AsyncByteStream):
    """The chunks as server-sent events, one per network chunk: ``data: <json>`` and a blank
    line, CRLF as Google sends them."""

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield f"data: {json.dumps(chunk)}\r\n\r\n".encode()
