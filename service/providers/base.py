"""The provider port.

A provider turns a request (replay items + the new user input item) into a stream of
events: zero or more ``TextDelta`` and exactly one final ``Reply`` (the last event). With
``stream=False`` an adapter may make a non-streaming call and yield the ``Reply`` alone.
Failures are raised as domain errors (RateLimited, ContextLengthExceeded, ContentFiltered,
UpstreamError, UpstreamTimeout); an adapter never retries on its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from service.model import Origin, ReplyStatus


@dataclass(frozen=True)
class ProviderRequest:
    input_items: list[msgspec.Raw]
    instructions: str | None = None
    tools: msgspec.Raw | None = None  # the function tools advertised, already encoded


@dataclass(frozen=True)
class TextDelta:
    text: str
    item_id: str | None = None  # the output message it belongs to, when the provider says


@dataclass(frozen=True)
class Reply:
    """The provider's final answer: its text and its output items, verbatim."""

    text: str
    status: ReplyStatus
    incomplete_reason: str | None
    output_items: list[msgspec.Raw]


ProviderEvent = TextDelta | Reply


class RequestBody(msgspec.Struct, omit_defaults=True):
    """A Responses API request. ``input`` holds raw items: msgspec splices them as they are."""

    model: str
    input: list[msgspec.Raw]
    store: bool
    include: list[str]
    stream: bool
    instructions: str | None = None
    tools: msgspec.Raw | None = None


def encode_request(model: str, request: ProviderRequest, *, stream: bool) -> bytes:
    body = RequestBody(
        model=model,
        input=request.input_items,
        store=False,
        include=["reasoning.encrypted_content"],
        stream=stream,
        instructions=request.instructions,
        tools=request.tools,
    )
    return msgspec.json.encode(body)


def request_overhead(
    model: str, instructions: str | None, tools: msgspec.Raw | None, *, stream: bool
) -> int:
    """Bytes of a serialised request with an empty ``input`` list (every provider sends the
    Responses API's shape; the fake is sized like it, so budgets behave as in production)."""
    return len(encode_request(model, ProviderRequest([], instructions, tools), stream=stream))


class Provider(Protocol):
    origin: Origin  # recorded with each turn whose replay items this provider produced

    def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        """Yield the reply's events; closing the iterator early cancels the upstream call."""

    async def close(self) -> None: ...


class _ItemHead(msgspec.Struct):
    type: str | None = None
    encrypted_content: str | None = None


@dataclass(frozen=True)
class FunctionCall:
    call_id: str
    name: str
    arguments: str  # the model's JSON text, unparsed: the tool gate judges it


class _FunctionCallItem(msgspec.Struct):
    type: str | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = ""


def function_calls(items: list[msgspec.Raw]) -> list[FunctionCall]:
    """The ``function_call`` items among a reply's output items, in order."""
    heads = (msgspec.json.decode(item, type=_FunctionCallItem) for item in items)
    return [
        FunctionCall(h.call_id, h.name, h.arguments) for h in heads if h.type == "function_call"
    ]


def function_outputs(items: Sequence[msgspec.Raw]) -> list[FunctionCall]:
    """The ``function_call_output`` items among ``items`` (their call ids), in order."""
    heads = (msgspec.json.decode(item, type=_FunctionCallItem) for item in items)
    return [FunctionCall(h.call_id, "", "") for h in heads if h.type == "function_call_output"]


class _InputHead(msgspec.Struct):
    type: str | None = None
    role: str | None = None


def input_count(items: Sequence[msgspec.Raw]) -> int:
    """How many of a turn's items are its input (function outputs and messages the client
    sent), not the provider's output: the leading ones that are not the assistant's."""
    for index, item in enumerate(items):
        head = msgspec.json.decode(item, type=_InputHead)
        if head.type not in (None, "message", "function_call_output") or head.role == "assistant":
            return index
    return len(items)


def open_calls(items: Sequence[msgspec.Raw]) -> set[str]:
    """The call ids of the function calls among ``items`` that no output among them answers."""
    heads = [msgspec.json.decode(item, type=_FunctionCallItem) for item in items]
    called = {h.call_id for h in heads if h.type == "function_call"}
    return called - {h.call_id for h in heads if h.type == "function_call_output"}


def function_call_output(call_id: str, output: str) -> msgspec.Raw:
    item = {"type": "function_call_output", "call_id": call_id, "output": output}
    return msgspec.Raw(msgspec.json.encode(item))


def is_sealed_reasoning(item: msgspec.Raw) -> bool:
    """A reasoning item whose encrypted_content only the provider that made it can open."""
    head = msgspec.json.decode(item, type=_ItemHead)
    return head.type == "reasoning" and bool(head.encrypted_content)


def user_input_item(text: str) -> msgspec.Raw:
    """The Responses API input item for a user message."""
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return msgspec.Raw(msgspec.json.encode(item))
