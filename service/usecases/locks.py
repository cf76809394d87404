"""Per-conversation locks for one process (a registry that cannot grow without bound), and
running an awaitable to its end though its caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable
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

    def taken(self, key: Hashable) -> bool:
        """Whether someone holds or waits for ``key``'s lock."""
        return key in self._entries

    def hold(self, key: Hashable, *, wait_s: float | None = None) -> _Held:
        """``async with`` it to hold ``key``'s lock, waiting at most ``wait_s`` for it (None: as
        long as it takes; 0: not at all). TimeoutError when it stayed taken."""
        return _Held(self._entries, key, wait_s)


class _Held:
    """One hold of a key's lock (a class, not a generator: every turn takes one)."""

    __slots__ = ("_entries", "_entry", "_key", "_wait_s")

    def __init__(
        self, entries: dict[Hashable, _Entry], key: Hashable, wait_s: float | None
    ) -> None:
        self._entries, self._key, self._wait_s = entries, key, wait_s
        self._entry: _Entry | None = None

    async def __aenter__(self) -> None:
        entry = self._entries.get(self._key)
        if entry is None:  # nobody holds or waits for it: taken at once
            entry = self._entries[self._key] = _Entry()
            entry.users = 1
            await entry.lock.acquire()  # a free asyncio.Lock is taken without suspending
            self._entry = entry
            return
        entry.users += 1
        try:
            if self._wait_s is not None and self._wait_s <= 0 and entry.lock.locked():
                raise TimeoutError()
            async with asyncio.timeout(self._wait_s):
                await entry.lock.acquire()
        except BaseException:
            self._leave(entry)
            raise
        self._entry = entry

    async def __aexit__(self, *_: object) -> None:
        entry = self._entry
        assert entry is not None  # entered
        entry.lock.release()
        self._leave(entry)

    def _leave(self, entry: _Entry) -> None:
        entry.users -= 1
        if entry.users == 0:
            del self._entries[self._key]


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
