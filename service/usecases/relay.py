"""The stateless call (``POST /v1/responses`` with ``store: false``): a client that keeps its
own history uses turnstore as its model endpoint, and nothing is committed. The history it
sends back is restored first (service/usecases/restore.py), for the model the call goes to;
the opaque content of what the provider answers is sealed with that model
(service/core/ids.py ``Ids.seal``) before the client sees it, so that when it comes back
turnstore knows which model made it (another model's is left out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import msgspec

from service.core.asks import Asked
from service.core.errors import ProviderRefused
from service.core.ids import Ids
from service.core.items import check_history
from service.core.model import Origin
from service.core.plans import PlanRules
from service.core.translate import form_of, is_opaque, provider_id, relayed
from service.core.window import SystemPrompt, instructions_for
from service.platform import metrics
from service.providers import base
from service.usecases.exchange import advertised
from service.usecases.restore import Restorer


class Relay:
    def __init__(
        self,
        restorer: Restorer,
        provider: base.Provider,
        prompt: SystemPrompt | None,
        rules: PlanRules,
    ) -> None:
        self._restorer, self._provider = restorer, provider
        self._prompt, self._rules = prompt, rules

    def origin(self, model: str | None) -> Origin:
        """Who answers a call for ``model``."""
        return self._provider.origin_for(model)

    async def resolve(
        self, owner: str, items: Sequence[dict[str, Any]], model: str | None
    ) -> list[msgspec.Raw]:
        """The input to send to ``model``: a history with a user message, restored
        (service/usecases/restore.py)."""
        check_history(items)
        return await self._restorer.restore(owner, items, origin=self.origin(model))

    async def compact(self, items: list[msgspec.Raw], asked: Asked) -> base.Compacted:
        """The provider's compaction of ``items`` (``POST /v1/responses/compact``): nothing is
        kept. A refusal of the request is the client's (400)."""
        prompt = instructions_for(
            self._prompt,
            asked.instructions,
            server_first=self._rules.server_prompt_first(asked.instructions),
        )
        request = base.ProviderRequest(items, prompt.text if prompt else None, model=asked.model)
        try:
            compacted = await self._provider.compact(request)
        except ProviderRefused as refused:
            raise refused.client_error() from refused
        if compacted.usage is not None:
            metrics.tokens_used(asked.model or self._provider.origin.model, compacted.usage)
        sealing = _Sealing(await self._restorer.ids.get(), self.origin(asked.model))
        return dataclasses.replace(compacted, items=sealing.items(compacted.items))

    async def count(self, items: list[msgspec.Raw], asked: Asked) -> int:
        """The provider's count of the input tokens a call on ``items`` would cost (``POST
        /v1/responses/input_tokens``): nothing is kept. A refusal is the client's (400)."""
        try:
            return await self._provider.count_tokens(self._request(items, asked, counted=True))
        except ProviderRefused as refused:
            raise refused.client_error() from refused

    def _request(
        self, items: list[msgspec.Raw], asked: Asked, counted: bool
    ) -> base.ProviderRequest:
        """The provider request a client asked: its items, the prompt (INSTRUCTIONS), the
        function tools it runs itself, its model and fields (what to include: not counted)."""
        prompt = instructions_for(
            self._prompt,
            asked.instructions,
            server_first=self._rules.server_prompt_first(asked.instructions),
        )
        text = prompt.text if prompt else None
        include = () if counted else asked.include
        tools = advertised(None, asked.tools)
        return base.ProviderRequest(items, text, tools, asked.model, asked.fields, include)

    async def respond(self, items: list[msgspec.Raw], asked: Asked) -> base.Reply:
        """One provider call on ``items``, offering the client's tools and asking what the
        client asked; nothing is kept. A refusal of the request is the client's (400)."""
        reply = None
        async with aclosing(self.stream(items, asked, stream=False)) as events:
            async for event in events:
                reply = event if isinstance(event, base.Reply) else reply
        assert reply is not None  # ``replied`` raises without one
        return reply

    async def stream(
        self, items: list[msgspec.Raw], asked: Asked, *, stream: bool = True
    ) -> AsyncGenerator[base.ProviderEvent, None]:
        """The same call, its events as the provider sends them (closing it early closes the
        upstream request)."""
        request = self._request(items, asked, counted=False)
        sealing = _Sealing(await self._restorer.ids.get(), self.origin(asked.model))
        try:
            async with aclosing(
                base.replied(self._provider.respond(request, stream=stream))
            ) as got:
                async for event in got:
                    if isinstance(event, base.Reply) and event.usage is not None:
                        model = asked.model or self._provider.origin.model
                        metrics.tokens_used(model, event.usage)
                    yield sealing.event(event)
        except ProviderRefused as refused:
            raise refused.client_error() from refused


class _Sealing:
    """What a client that keeps its history is shown of opaque items: their content sealed
    with the model that made them (service/core/ids.py)."""

    def __init__(self, ids: Ids, origin: Origin) -> None:
        self._ids, self._origin = ids, origin
        # A provider that names no message (Anthropic): its text's deltas and its first text
        # block, shown as one message, share the id given here.
        self._message_id: str | None = None

    def event(self, event: base.ProviderEvent) -> base.ProviderEvent:
        if isinstance(event, base.ItemDone):
            return dataclasses.replace(event, item=self.item(event.item))
        if isinstance(event, base.Reply):
            return dataclasses.replace(event, output_items=self.items(event.output_items))
        if event.item_id is None:
            self._message_id = self._message_id or provider_id("message")
            return dataclasses.replace(event, item_id=self._message_id)
        return event

    def items(self, items: Sequence[msgspec.Raw]) -> list[msgspec.Raw]:
        return [shown for item in items for shown in self._shown(item)]

    def item(self, raw: msgspec.Raw) -> msgspec.Raw:
        """An item finished before the text (reasoning: shown as one item)."""
        return self._shown(raw)[0]

    def _shown(self, raw: msgspec.Raw) -> list[msgspec.Raw]:
        if form_of(raw) is not None:  # a provider's own: the Responses items it reads as
            shown = relayed(raw, lambda content: self._ids.seal(self._origin, content))
            said = next((item for item in shown if item["type"] == "message"), None)
            if said is not None and self._message_id is not None:
                said["id"], self._message_id = self._message_id, None  # its deltas' message
            return [msgspec.Raw(msgspec.json.encode(item)) for item in shown]
        if not is_opaque(raw):
            return [raw]
        item = msgspec.json.decode(raw)
        sealed = self._ids.seal(self._origin, item["encrypted_content"])
        return [msgspec.Raw(msgspec.json.encode({**item, "encrypted_content": sealed}))]
