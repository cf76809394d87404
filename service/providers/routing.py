"""Several providers behind the one port, routed by model.

``Routed`` is what the use cases hold when PROVIDERS_FILE names several providers: each model
is served by exactly one of them (the file's reader refused a model named twice), a request
naming no model goes to the default model's provider, and each turn's origin is the origin of
the provider that answered it, so its opaque items go back only there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace

from service.core.model import Origin
from service.providers.base import Compacted, Provider, ProviderEvent, ProviderRequest


class Routed:
    def __init__(self, served: Sequence[tuple[str, Provider, Sequence[str]]], default: str) -> None:
        """``served``: each provider's name, the provider and the models it serves, in the
        order GET /v1/models lists them; ``default``: the model of a request that names none."""
        self._providers = [provider for _, provider, _ in served]
        self._routes = {model: (name, p) for name, p, models in served for model in models}
        self.default_model = default
        self.origin = self._routes[default][1].origin.with_model(default)

    @property
    def models(self) -> list[tuple[str, str]]:
        """Every model served, with its provider's name."""
        return [(model, name) for model, (name, _) in self._routes.items()]

    def origin_for(self, model: str | None) -> Origin:
        model = model or self.default_model
        return self._route(model).origin_for(model)

    def compacts(self, model: str | None) -> bool:
        return self._route(model or self.default_model).compacts(model)

    def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        model = request.model or self.default_model
        return self._route(model).respond(replace(request, model=model), stream=stream)

    async def compact(self, request: ProviderRequest) -> Compacted:
        model = request.model or self.default_model
        return await self._route(model).compact(replace(request, model=model))

    async def count_tokens(self, request: ProviderRequest) -> int:
        model = request.model or self.default_model
        return await self._route(model).count_tokens(replace(request, model=model))

    async def close(self) -> None:
        for provider in self._providers:
            await provider.close()

    def _route(self, model: str) -> Provider:
        # A model no provider serves was refused before any call (PlanRules.check_model).
        return self._routes[model][1]
