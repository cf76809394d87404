"""This process's subscribers to notification topics, and handing a notification to them:
the fan-out under every ``Notifications`` (PostgreSQL's LISTEN in listener.py; on its own, the
notifications of one process, as a test's in-memory store uses them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Subscribers:
    healthy = True  # within one process nothing is lost

    def __init__(self) -> None:
        self._inboxes: dict[str, set[asyncio.Event]] = {}

    @asynccontextmanager
    async def subscribe(self, topic: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever ``topic`` is notified while inside."""
        inbox = asyncio.Event()
        self._inboxes.setdefault(topic, set()).add(inbox)
        try:
            yield inbox
        finally:
            subscribers = self._inboxes[topic]
            subscribers.discard(inbox)
            if not subscribers:
                del self._inboxes[topic]

    def notify(self, topic: str) -> None:
        for inbox in self._inboxes.get(topic, ()):
            inbox.set()

    def wake_all(self) -> None:
        """Anything may have been missed (a listener reconnected): everyone looks again."""
        for inboxes in self._inboxes.values():
            for inbox in inboxes:
                inbox.set()
