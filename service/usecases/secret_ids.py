"""The deployment's own ids (service/core/ids.py), made once per process from its secret,
which the backend reads on first use (the same on every replica: ``turnstore_secrets``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from service.core.ids import Ids


class IdsSource:
    """The deployment's Ids, made on first use from its secret (``secret``: reads it; once
    per process), or at once from a secret in hand."""

    def __init__(self, secret: Callable[[], Awaitable[bytes]] | bytes) -> None:
        self._read = secret if callable(secret) else None
        self._ids = Ids(secret) if isinstance(secret, bytes) else None
        self._lock = asyncio.Lock()

    async def get(self) -> Ids:
        if self._ids is None:
            async with self._lock:
                if self._ids is None:
                    assert self._read is not None
                    self._ids = Ids(await self._read())
        return self._ids
