"""The built-in offline provider: ``[fake-llm] <message>`` plus ``(history=N)``.

It behaves like the real Responses API where turnstore depends on it: each reply carries a
``reasoning`` item with an opaque ``encrypted_content`` and a ``message`` item, and a
reasoning item it gets back must be one it issued, byte for byte (otherwise it fails like
the real API does with ``invalid_encrypted_content``), so broken replay cannot go unnoticed.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncGenerator, Mapping

import msgspec

from service.core.errors import InvalidEncryptedContent, UpstreamError
from service.core.model import Origin
from service.providers.base import ProviderEvent, ProviderRequest, Reply, TextDelta

_SEAL_KEY = b"turnstore-fake-provider"


class _ItemHead(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    id: str | None = None
    encrypted_content: str | None = None
    output: str | None = None  # of a function_call_output


class _ToolName(msgspec.Struct):
    name: str = ""


def _seal(item_id: str) -> str:
    digest = hashlib.sha256(_SEAL_KEY + item_id.encode()).digest()
    return base64.b64encode(digest * 4).decode()


class FakeProvider:
    origin = Origin("fake", "builtin", "fake-llm")

    def __init__(self, *, deltas: int = 4) -> None:
        self._deltas = deltas

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        heads = [msgspec.json.decode(item, type=_ItemHead) for item in request.input_items]
        for head in heads:
            if head.type == "reasoning" and (
                head.id is None or head.encrypted_content != _seal(head.id)
            ):
                raise InvalidEncryptedContent()
        users = [i for i, h in enumerate(heads) if h.role == "user"]
        if not users:
            raise UpstreamError("The fake provider answers user messages only.")
        current = users[-1]
        history = sum(1 for h in heads[:current] if h.role in ("user", "assistant"))
        message = _last_user_text(request.input_items[current])
        tool_outputs = [h.output for h in heads[current:] if h.type == "function_call_output"]
        name, _, arguments = message.removeprefix("call ").partition(" ")
        if message.startswith("call ") and not tool_outputs and _offers(request, name):
            # "call <tool> <arguments>" asks for a call of a tool the client offered (/v1).
            yield Reply("", "completed", None, _call_items(name, arguments or "{}", history))
            return
        if message.startswith("lookup ") and not tool_outputs and _offers(request, "lookup"):
            # "lookup <key>" asks the lookup tool first, so `make run` can show a tool turn.
            arguments = msgspec.json.encode({"key": message[7:].strip()}).decode()
            yield Reply("", "completed", None, _call_items("lookup", arguments, history))
            return
        text = f"[fake-llm] {message}" + (f" (history={history})" if history else "")
        text += "".join(f" [tool: {output}]" for output in tool_outputs)
        key = _key(f"{history}:{text}")
        if stream:
            for chunk in _split(text, self._deltas):
                yield TextDelta(chunk, f"msg_{key}")
        yield Reply(text, "completed", None, _output_items(text, key))

    async def close(self) -> None:
        return None


class _InputText(msgspec.Struct):
    text: str = ""


class _UserItem(msgspec.Struct):
    content: str | list[_InputText] = ""


def _last_user_text(item: msgspec.Raw) -> str:
    content = msgspec.json.decode(item, type=_UserItem).content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _offers(request: ProviderRequest, name: str) -> bool:
    tools = msgspec.json.decode(request.tools, type=list[_ToolName]) if request.tools else []
    return any(tool.name == name for tool in tools)


def _call_items(name: str, arguments: str, history: int) -> list[msgspec.Raw]:
    key = _key(f"{history}:{name}:{arguments}")
    call = {
        "type": "function_call",
        "id": f"fc_{key}",
        "call_id": f"call_{key}",
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }
    return _sealed_reasoning_then(key, call)


def _split(text: str, parts: int) -> list[str]:
    size = max(1, -(-len(text) // parts))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _key(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:24]


def _output_items(text: str, key: str) -> list[msgspec.Raw]:
    message = {
        "type": "message",
        "id": f"msg_{key}",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return _sealed_reasoning_then(key, message)


def _sealed_reasoning_then(key: str, item: Mapping[str, object]) -> list[msgspec.Raw]:
    """A reasoning item sealed by this fake, then the item it precedes."""
    reasoning_id = f"rs_{key}"
    reasoning = {
        "type": "reasoning",
        "id": reasoning_id,
        "summary": [],
        "encrypted_content": _seal(reasoning_id),
    }
    return [msgspec.Raw(msgspec.json.encode(reasoning)), msgspec.Raw(msgspec.json.encode(item))]
