"""One turn's exchange with the provider: model -> tool calls -> model ... -> final answer.

Yields text deltas and tool-call results as they happen, then one ``Answer`` holding the
final reply, every output item and function_call_output of the turn in order, and the
record of each tool call. Nothing here touches storage: the turn service commits the answer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import msgspec

from service.core.errors import (
    ContextLengthExceeded,
    InvalidEncryptedContent,
    ProviderRefused,
    UpstreamError,
)
from service.core.items import function_call_output, function_calls, placed
from service.core.model import Origin, ToolCallRecord
from service.core.usage import Usage
from service.core.window import SystemPrompt, Window, request_bytes
from service.platform import metrics, tracing
from service.providers.base import (
    ItemDone,
    Provider,
    ProviderRequest,
    Reply,
    TextDelta,
    replied,
)
from service.tools.executor import ToolExecutor
from service.tools.gate import ToolGate
from service.tools.registry import ToolRegistry


@dataclass(frozen=True)
class Tooling:
    """Server-side tools: what is advertised and how calls are gated."""

    registry: ToolRegistry
    executor: ToolExecutor
    call_budget: int = 8
    timeout_s: float = 5.0
    max_rounds: int = 4
    definitions: msgspec.Raw = field(init=False)

    def __post_init__(self) -> None:
        encoded = msgspec.Raw(msgspec.json.encode(self.registry.definitions()))
        object.__setattr__(self, "definitions", encoded)


@dataclass(frozen=True)
class ToolCalled:
    name: str
    status: str


@dataclass(frozen=True)
class Answer:
    reply: Reply
    items: list[msgspec.Raw]  # this turn's output items and tool outputs, in order
    tool_calls: list[ToolCallRecord]
    client_calls: bool = False  # it ends in calls of the client's own tools, for it to run
    usage: Usage | None = None  # of every provider call of the turn, added up


ExchangeEvent = ItemDone | TextDelta | ToolCalled | Answer


@dataclass(frozen=True)
class ProviderAsk:
    """What one turn asks of the provider besides its input items."""

    prompt: SystemPrompt | None  # the instructions sent, and their version (digest)
    origin: Origin  # the provider, endpoint and model that answer it
    template: ProviderRequest  # every call of the turn, but its input items
    overhead: int  # its bytes without input items (the context budget counts them)
    client_names: frozenset[str] = frozenset()  # the client's own tools: it runs their calls
    relayed: bool = False  # asked by a client: the provider's refusal of it is the client's


class Exchange:
    def __init__(
        self,
        provider: Provider,
        window: Window,
        new_items: list[msgspec.Raw],
        asked: ProviderAsk,
        *,
        tooling: Tooling | None,
        stream: bool,
        max_request_bytes: int,
    ) -> None:
        self._provider = provider
        self._window = window
        self._new_items = new_items
        self._request = asked.template  # all but its input items: instructions, tools, model
        self._client_names = asked.client_names
        self._tooling = tooling
        self._stream = stream
        self._overhead = asked.overhead  # the request's bytes besides its input items
        self._max_request_bytes = max_request_bytes
        self._relayed = asked.relayed
        self._drop_sealed = False
        self._streamed = False
        self._usage: Usage | None = None

    async def events(self) -> AsyncGenerator[ExchangeEvent, None]:
        tooling, gate, max_rounds = self._tooling, None, 1
        if tooling is not None:  # the per-turn call budget lives in this turn's gate
            budget, timeout_s = tooling.call_budget, tooling.timeout_s
            gate = ToolGate(tooling.registry, tooling.executor, budget=budget, timeout_s=timeout_s)
            max_rounds = tooling.max_rounds
        items: list[msgspec.Raw] = []
        records: list[ToolCallRecord] = []
        for round_number in range(1, max_rounds + 1):
            reply: Reply | None = None
            done = 0  # items of this round finished before its text
            async with aclosing(self._round(items)) as round_events:
                async for event in round_events:
                    if isinstance(event, Reply):
                        reply = event
                        continue
                    if isinstance(event, ItemDone):
                        done += not event.partial
                    elif event.item_id is None:  # a provider that names no message (Anthropic)
                        # It is known by its place in the turn: after the input, the earlier
                        # rounds' items and this round's finished ones.
                        place = placed(len(self._new_items) + len(items) + done)
                        event = replace(event, item_id=place)
                    yield event
            assert reply is not None  # a round ends with its reply or raises (``replied``)
            if reply.usage is not None:
                self._usage = reply.usage if self._usage is None else self._usage + reply.usage
                metrics.tokens_used(self._request.model or self._provider.origin.model, reply.usage)
            items.extend(reply.output_items)
            calls = function_calls(reply.output_items)
            theirs = [call for call in calls if call.name in self._client_names]
            calls = [call for call in calls if call.name not in self._client_names]
            if not calls or gate is None:
                yield Answer(reply, items, records, bool(theirs), self._usage)
                return
            if round_number == max_rounds and not theirs:
                break
            for call in calls:  # one after another, through the whole gate
                with tracing.span("tool.call") as span:
                    record = await gate.call(call.call_id, call.name, call.arguments)
                    span.set_attributes(
                        {"tool.name": record.name, "tool.status": str(record.status)}
                    )
                records.append(record)
                items.append(function_call_output(call.call_id, record.output()))
                yield ToolCalled(record.name, record.status)
            if theirs:  # the client runs its own calls: the turn ends here, to be answered
                yield Answer(reply, items, records, True, self._usage)
                return
        raise UpstreamError("The model still wanted tools after TOOL_MAX_ROUNDS rounds.")

    def _check_size(self, request: ProviderRequest) -> None:
        """A tool round adds this turn's items to a window chosen for the first round: the
        byte budget still holds (the window is never trimmed mid-turn)."""
        if request_bytes(self._overhead, request.input_items) > self._max_request_bytes:
            raise ContextLengthExceeded("The tool results no longer fit the context budget.")

    async def _round(
        self, turn_items: list[msgspec.Raw]
    ) -> AsyncGenerator[ItemDone | TextDelta | Reply, None]:
        """One provider call, with the one retry without sealed reasoning."""
        while True:
            window = self._window
            history = window.unsealed if self._drop_sealed else window.items
            request = replace(
                self._request,
                input_items=[*history, *self._new_items, *turn_items],
                plain=len(history) if window.plain else 0,  # its Responses items stay so unsealed
            )
            if turn_items:
                self._check_size(request)
            model = self._request.model or self._provider.origin.model
            try:
                with (
                    metrics.PROVIDER_SECONDS.time(),
                    tracing.span("provider.round") as span,
                ):
                    span.set_attribute("provider.model", model)
                    span.set_attribute("provider.input_items", len(request.input_items))
                    # aclosing: a client that goes away closes the upstream request at once.
                    async with aclosing(
                        replied(self._provider.respond(request, stream=self._stream))
                    ) as events:
                        async for event in events:
                            self._streamed = self._streamed or not isinstance(event, Reply)
                            yield event
                return
            except ProviderRefused as refused:
                if self._relayed:
                    raise refused.client_error() from refused
                raise
            except InvalidEncryptedContent:
                # The provider cannot open some sealed reasoning (a key or organisation
                # changed): resend without any, once, if that changes the request.
                if self._drop_sealed or self._streamed or window.unsealed == history:
                    raise
                self._drop_sealed = True
                metrics.series(metrics.PROVIDER_RETRIES, model).inc()


class _Named(msgspec.Struct):
    name: str


def tool_names(tools: tuple[msgspec.Raw, ...]) -> frozenset[str]:
    return frozenset(msgspec.json.decode(tool, type=_Named).name for tool in tools)


def advertised(
    tooling: Tooling | None, client_tools: tuple[msgspec.Raw, ...]
) -> msgspec.Raw | None:
    """The function tools the model is offered: turnstore's own, then the client's."""
    if not client_tools:
        return tooling.definitions if tooling else None
    own = bytes(tooling.definitions)[1:-1] if tooling else b""
    parts = [part for part in (own, *map(bytes, client_tools)) if part]
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")
