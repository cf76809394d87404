"""The app of the durable-turns run: the fake provider typing ``DRIP_DELTAS`` deltas, one every
``DRIP_S`` seconds, each the wall-clock time it was sent (``time.time()``), so a reader
anywhere on this machine can tell how late each delta reached it.

Served as ``uvicorn --factory bench.drip_app:create`` with DATABASE_URL set."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator

from litestar import Litestar

from service.app import create_app
from service.platform.settings import Settings
from service.providers.base import ProviderEvent, ProviderRequest, Reply, TextDelta
from service.providers.fake import FakeProvider


class DrippingFakeProvider(FakeProvider):
    def __init__(self, deltas: int, drip_s: float) -> None:
        super().__init__()
        self._count, self._drip_s = deltas, drip_s

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        sent = []
        for _ in range(self._count if stream else 0):
            await asyncio.sleep(self._drip_s)
            sent.append(f"{time.time():.6f} ")
            yield TextDelta(sent[-1])
        async for event in super().respond(request, stream=False):
            if isinstance(event, Reply) and sent:  # the fake's items, the text the client saw
                event = Reply("".join(sent), "completed", None, event.output_items)
            yield event


def create() -> Litestar:
    deltas, drip_s = int(os.environ["DRIP_DELTAS"]), float(os.environ["DRIP_S"])
    return create_app(Settings.from_env(), provider=DrippingFakeProvider(deltas, drip_s))
