"""The app of the holding-power run: the fake provider, taking 2 s before each reply.

Served as ``uvicorn --factory bench.slow_app:create`` with DATABASE_URL set."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from litestar import Litestar

from service.app import create_app
from service.platform.settings import Settings
from service.providers.base import ProviderEvent, ProviderRequest
from service.providers.fake import FakeProvider

DELAY_S = 2.0


class SlowFakeProvider(FakeProvider):
    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        await asyncio.sleep(DELAY_S)
        async for event in super().respond(request, stream=stream):
            yield event


def create() -> Litestar:
    return create_app(Settings.from_env(), provider=SlowFakeProvider())
