"""Per-conversation locks for one process (a registry that cannot grow without bound), and
running an awaitable to its end though its caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Hashable
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class KeyedLocks:
    """``async with locks.hold(key)`` serialises holders of one key; an entry exists only
    while someone holds or waits for its lock."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @asynccontextmanager
    async def hold(self, key: Hashable, *, wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold ``key``'s lock, waiting at most ``wait_s`` for it (None: as long as it takes;
        0: not at all). TimeoutError when it stayed taken."""
        entry = self._entries.setdefault(key, _Entry())
        entry.users += 1
        try:
            if wait_s is not None and wait_s <= 0 and entry.lock.locked():
                raise TimeoutError()
            async with asyncio.timeout(wait_s):
                await entry.lock.acquire()
            try:
                yield
            finally:
                entry.lock.release()
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]


async def settle(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end even if the caller is cancelled meanwhile (a client that
    disconnects mid-commit): a transaction is then either fully committed or not at all, and
    what the caller holds is not let go while it is still in flight."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError()
    return result
