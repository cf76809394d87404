"""The built-in offline provider: ``[fake-llm] <message>`` plus ``(history=N)``.

It behaves like the real Responses API where turnstore or a client can tell:

- each reply carries a ``reasoning`` item with an opaque ``encrypted_content``, sealed for the
  model that made it; a reasoning item it gets back must be one it issued for the same model,
  byte for byte (otherwise it fails like the real API, ``invalid_encrypted_content``), so
  broken replay or a model switch that resends sealed reasoning cannot go unnoticed;
- a request field the Responses API does not have is refused (400 ``unknown_parameter`` with
  its ``param``); ``max_output_tokens`` stops the reply (``incomplete``); ``text.format``
  ``json_schema`` is answered with a JSON document valid against the schema; ``tool_choice``
  naming a function calls it (``required``: the first tool offered; ``none``: no call);
- ``usage`` is deterministic: a token is four bytes of the request's input (and
  instructions), or four characters of the reply;
- ``compact`` keeps the input's user messages and adds one ``compaction`` item sealed for the
  model, whose id says how many items it stands for; when one comes back it is checked like
  sealed reasoning, and the reply says ``(history=N, compacted=M)``;
- its ids have the API's shape: a prefix and 48 hex digits; a stream announces the reasoning
  item (``ItemDone``) before the text, as the API does.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace
from typing import Any

import msgspec

from service.core.errors import InvalidEncryptedContent, ProviderRefused, UpstreamError
from service.core.model import Origin
from service.core.translate import to_items
from service.core.usage import Usage
from service.providers import base
from service.providers.fake_schema import instance

_SEAL_KEY = b"turnstore-fake-provider"
MODEL = "fake-llm"
REASONING_TOKENS = 4  # what its sealed reasoning "costs"
# The top-level fields of a Responses API request (openai-python's ResponseCreateParams), less
# those turnstore sets itself.
KNOWN_FIELDS = frozenset(
    {
        "access_programs",
        "background",
        "background_options",
        "context_management",
        "conversation",
        "image",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "moderation",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
    }
)


class _ItemHead(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    id: str | None = None
    encrypted_content: str | None = None
    output: Any = None  # of a function_call_output


class _Tool(msgspec.Struct):
    name: str = ""
    parameters: Any = None


class _Format(msgspec.Struct):
    type: str = "text"
    schema: Any = None


class _Text(msgspec.Struct):
    format: _Format | None = None


class _NamedChoice(msgspec.Struct):
    type: str = ""
    name: str = ""


@functools.lru_cache(maxsize=4096)  # every turn checks the seals of its whole history again
def _seal(model: str, item_id: str) -> str:
    # The default model's seal is the one of releases without model choice: their
    # conversations keep replaying.
    bound = b"" if model == MODEL else model.encode() + b"\0"
    digest = hashlib.sha256(_SEAL_KEY + bound + item_id.encode()).digest()
    return base64.b64encode(digest * 4).decode()


class FakeProvider(base.Provider):
    def __init__(self, *, deltas: int = 4, name: str = "fake") -> None:
        self._deltas = deltas
        self.origin = Origin(name, "builtin", MODEL, "fake")

    async def respond(
        self, request: base.ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        _check_fields(request.fields)
        request = _translated(request)
        model = request.model or MODEL
        heads = _checked(request, model)
        compacted = _compacted(heads)
        users = [i for i, h in enumerate(heads) if h.role == "user"]
        if not users:
            raise UpstreamError("The fake provider answers user messages only.")
        current = users[-1]
        history = sum(1 for h in heads[:current] if h.role in ("user", "assistant"))
        message = _last_user_text(request.input_items[current])
        tool_outputs = [h.output for h in heads[current:] if h.type == "function_call_output"]
        usage_in = _tokens(sum(map(len, request.input_items)) + len(request.instructions or ""))
        call = None if tool_outputs else _call_asked(request, message)
        if call is not None:
            name, arguments = call
            items = _call_items(model, name, arguments, history)
            if stream:  # its reasoning first, as the Responses API streams it
                yield base.ItemDone(items[0])
            yield base.Reply("", "completed", None, items, _usage(usage_in, 0))
            return
        text = _answer(request, message, history, tool_outputs, compacted)
        status, reason = "completed", None
        limit = _max_output_tokens(request.fields)
        if limit is not None and _tokens(len(text)) > limit:
            text, status, reason = text[: 4 * limit], "incomplete", "max_output_tokens"
        key = _key(f"{history}:{text}", model)
        items = _output_items(model, text, key)
        if stream:
            yield base.ItemDone(items[0])  # its reasoning first, as the Responses API streams it
            for chunk in _split(text, self._deltas):
                yield base.TextDelta(chunk, f"msg_{key}")
        usage = _usage(usage_in, _tokens(len(text)))
        yield base.Reply(text, status, reason, items, usage)  # type: ignore[arg-type]

    async def compact(self, request: base.ProviderRequest) -> base.Compacted:
        """The user messages of the input, then one compaction item sealed for the model
        that names how many items it stands for."""
        request = _translated(request)
        model = request.model or MODEL
        heads = _checked(request, model)
        kept = [raw for raw, h in zip(request.input_items, heads, strict=True) if h.role == "user"]
        stands_for = len(request.input_items)
        key = _key(hashlib.sha256(b"".join(request.input_items)).hexdigest(), model)
        compaction_id = f"cmp_{key[:40]}{stands_for:08x}"  # 48 hex, the count in the last 8
        compaction = {
            "type": "compaction",
            "id": compaction_id,
            "encrypted_content": _seal(model, compaction_id),
        }
        item = msgspec.Raw(msgspec.json.encode(compaction))
        usage_in = _tokens(sum(map(len, request.input_items)) + len(request.instructions or ""))
        return base.Compacted([*kept, item], _usage(usage_in, _tokens(len(item)), reasoning=0))

    async def count_tokens(self, request: base.ProviderRequest) -> int:
        """What ``respond`` would report as the request's input tokens."""
        _check_fields(request.fields)
        request = _translated(request)
        _checked(request, request.model or MODEL)
        return _tokens(sum(map(len, request.input_items)) + len(request.instructions or ""))

    async def close(self) -> None:
        return None


_HEADS = msgspec.json.Decoder(list[_ItemHead])


def _translated(request: base.ProviderRequest) -> base.ProviderRequest:
    """The request as the Responses API takes it: another provider's items translated."""
    items = to_items(request.input_items, request.plain)
    return request if items is request.input_items else replace(request, input_items=items)


def _checked(request: base.ProviderRequest, model: str) -> list[_ItemHead]:
    """The input's items, each opaque one checked: a reasoning or compaction item this fake
    did not seal for ``model`` fails like the real API (invalid_encrypted_content)."""
    heads = _HEADS.decode(b"[" + b",".join(request.input_items) + b"]")  # in one call
    for head in heads:
        if head.type in ("reasoning", "compaction") and (
            head.id is None or head.encrypted_content != _seal(model, head.id)
        ):
            raise InvalidEncryptedContent()
    return heads


def _compacted(heads: list[_ItemHead]) -> int | None:
    """How many items the input's (latest) compaction item stands for, if it holds one."""
    found = [h for h in heads if h.type == "compaction" and h.id]
    if not found or not found[-1].id:
        return None
    tail = found[-1].id.removeprefix("cmp_")  # (earlier releases: cmp_<key>_<count>)
    return int(tail.rsplit("_", 1)[1]) if "_" in tail else int(tail[-8:], 16)


def _check_fields(fields: Mapping[str, msgspec.Raw]) -> None:
    for name in fields:
        if name not in KNOWN_FIELDS:
            raise ProviderRefused("unknown_parameter", name)


def _answer(
    request: base.ProviderRequest,
    message: str,
    history: int,
    tool_outputs: list[Any],
    compacted: int | None = None,
) -> str:
    said = f"history={history}" + (f", compacted={compacted}" if compacted is not None else "")
    text = f"[fake-llm] {message}" + (f" ({said})" if history or compacted is not None else "")
    text += "".join(f" [tool: {output}]" for output in tool_outputs)
    schema = _json_schema(request.fields)
    if schema is not None:  # structured outputs: a document valid against the schema
        return msgspec.json.encode(instance(schema, text)).decode()
    return text


def _call_asked(request: base.ProviderRequest, message: str) -> tuple[str, str] | None:
    """The tool call this request asks for, if any: by ``tool_choice``, or by the message
    ``call <tool> <json arguments>`` (``lookup <key>`` for the example lookup tool)."""
    tools = msgspec.json.decode(request.tools, type=list[_Tool]) if request.tools else []
    offered = {tool.name: tool for tool in tools}
    choice = _tool_choice(request.fields)
    if choice == "none" or not offered:
        return None
    if isinstance(choice, _NamedChoice) and choice.name in offered:
        return choice.name, _arguments(offered[choice.name], message)
    name, _, arguments = message.removeprefix("call ").partition(" ")
    if message.startswith("call ") and name in offered:
        return name, arguments or "{}"
    if message.startswith("lookup ") and "lookup" in offered:
        return "lookup", msgspec.json.encode({"key": message[7:].strip()}).decode()
    if choice == "required":
        first = tools[0]
        return first.name, _arguments(first, message)
    return None


def _arguments(tool: _Tool, message: str) -> str:
    schema = tool.parameters if isinstance(tool.parameters, dict) else {"type": "object"}
    return msgspec.json.encode(instance(schema, message)).decode()


def _field(fields: Mapping[str, msgspec.Raw], name: str, kind: Any) -> Any:
    """A passed-through field decoded as ``kind`` (None when absent), refused as OpenAI
    refuses a value of the wrong type."""
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError:
        raise ProviderRefused("invalid_type", name) from None


def _tool_choice(fields: Mapping[str, msgspec.Raw]) -> str | _NamedChoice | None:
    choice: str | _NamedChoice | None = _field(fields, "tool_choice", str | _NamedChoice)
    return choice


def _json_schema(fields: Mapping[str, msgspec.Raw]) -> dict[str, Any] | None:
    text: _Text | None = _field(fields, "text", _Text)
    if text is None:
        return None
    fmt = text.format
    if fmt is None or fmt.type != "json_schema":
        return None
    if not isinstance(fmt.schema, dict):
        raise ProviderRefused("missing_required_parameter", "text.format.schema")
    return fmt.schema


def _max_output_tokens(fields: Mapping[str, msgspec.Raw]) -> int | None:
    limit: int | None = _field(fields, "max_output_tokens", int | None)
    if limit is not None and limit < 1:
        raise ProviderRefused("integer_below_min_value", "max_output_tokens")
    return limit


def _tokens(size: int) -> int:
    return math.ceil(size / 4)


def _usage(input_tokens: int, text_tokens: int, reasoning: int = REASONING_TOKENS) -> Usage:
    output = text_tokens + reasoning
    return Usage(input_tokens, 0, output, reasoning, input_tokens + output)


class _InputText(msgspec.Struct):
    text: str = ""


class _UserItem(msgspec.Struct):
    content: str | list[_InputText] = ""


def _last_user_text(item: msgspec.Raw) -> str:
    content = msgspec.json.decode(item, type=_UserItem).content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _call_items(model: str, name: str, arguments: str, history: int) -> list[msgspec.Raw]:
    key = _key(f"{history}:{name}:{arguments}", model)
    call = {
        "type": "function_call",
        "id": f"fc_{key}",
        "call_id": f"call_{key}",
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }
    return _sealed_reasoning_then(model, key, call)


def _split(text: str, parts: int) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _key(seed: str, model: str = MODEL) -> str:
    """48 hex digits, as the Responses API's ids have after their prefix (``rs_``, ``msg_``,
    ``fc_``...): derived from what the reply says, so a fake conversation replays alike."""
    bound = "" if model == MODEL else f"{model}:"
    return hashlib.sha256((bound + seed).encode()).hexdigest()[:48]


def _output_items(model: str, text: str, key: str) -> list[msgspec.Raw]:
    message = {
        "type": "message",
        "id": f"msg_{key}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return _sealed_reasoning_then(model, key, message)


def _sealed_reasoning_then(model: str, key: str, item: Mapping[str, object]) -> list[msgspec.Raw]:
    """A reasoning item sealed by this fake for ``model``, then the item it precedes."""
    reasoning_id = f"rs_{key}"
    reasoning = {
        "type": "reasoning",
        "id": reasoning_id,
        "summary": [],
        "encrypted_content": _seal(model, reasoning_id),
    }
    return [msgspec.Raw(msgspec.json.encode(reasoning)), msgspec.Raw(msgspec.json.encode(item))]
