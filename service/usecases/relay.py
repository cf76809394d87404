"""The stateless call (``POST /v1/responses`` with ``store: false``): a client that keeps its
own history uses turnstore as its model endpoint, and nothing is committed. The history it
sends back is restored first (service/usecases/restore.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import msgspec

from service.core.errors import ProviderRefused
from service.core.items import check_history
from service.core.plans import Asked, PlanRules
from service.core.window import SystemPrompt, instructions_for
from service.platform import metrics
from service.providers.base import (
    Compacted,
    Provider,
    ProviderEvent,
    ProviderRequest,
    Reply,
    replied,
)
from service.usecases.exchange import advertised
from service.usecases.restore import Restorer


class Relay:
    def __init__(
        self,
        restorer: Restorer,
        provider: Provider,
        prompt: SystemPrompt | None,
        rules: PlanRules,
    ) -> None:
        self._restorer, self._provider = restorer, provider
        self._prompt, self._rules = prompt, rules

    async def resolve(self, owner: str, items: Sequence[dict[str, Any]]) -> list[msgspec.Raw]:
        """The input to send: a history with a user message, restored
        (service/usecases/restore.py)."""
        check_history(items)
        return await self._restorer.restore(owner, items)

    async def compact(self, items: list[msgspec.Raw], asked: Asked) -> Compacted:
        """The provider's compaction of ``items`` (``POST /v1/responses/compact``): nothing is
        kept. A refusal of the request is the client's (400)."""
        prompt = instructions_for(
            self._prompt, asked.instructions,
            server_first=self._rules.server_prompt_first(asked.instructions),
        )  # fmt: skip
        request = ProviderRequest(items, prompt.text if prompt else None, model=asked.model)
        try:
            compacted = await self._provider.compact(request)
        except ProviderRefused as refused:
            raise refused.client_error() from refused
        if compacted.usage is not None:
            metrics.tokens_used(asked.model or self._provider.origin.model, compacted.usage)
        return compacted

    async def respond(
        self, items: list[msgspec.Raw], tools: tuple[msgspec.Raw, ...], asked: Asked
    ) -> Reply:
        """One provider call on ``items``, offering the client's ``tools`` and asking what the
        client asked; nothing is kept. A refusal of the request is the client's (400)."""
        reply = None
        async with aclosing(self.stream(items, tools, asked, stream=False)) as events:
            async for event in events:
                reply = event if isinstance(event, Reply) else reply
        assert reply is not None  # ``replied`` raises without one
        return reply

    async def stream(
        self,
        items: list[msgspec.Raw],
        tools: tuple[msgspec.Raw, ...],
        asked: Asked,
        *,
        stream: bool = True,
    ) -> AsyncGenerator[ProviderEvent, None]:
        """The same call, its events as the provider sends them (closing it early closes the
        upstream request)."""
        prompt = instructions_for(
            self._prompt, asked.instructions,
            server_first=self._rules.server_prompt_first(asked.instructions),
        )  # fmt: skip
        request = ProviderRequest(
            items, prompt.text if prompt else None, advertised(None, tools), asked.model,
            asked.fields, asked.include,
        )  # fmt: skip
        try:
            async with aclosing(replied(self._provider.respond(request, stream=stream))) as got:
                async for event in got:
                    if isinstance(event, Reply) and event.usage is not None:
                        model = asked.model or self._provider.origin.model
                        metrics.tokens_used(model, event.usage)
                    yield event
        except ProviderRefused as refused:
            raise refused.client_error() from refused
