"""One background loop of this process, for what must be renewed while it lasts.

The turn leases this process holds (service/usecases/leases.py) and the runs it executes
(service/usecases/runs.py) each keep one: ``beat()`` every ``every_s`` (renewing what is
held) and, before that, ``between()`` every ``poll_s`` or at once when woken (giving back a
lease that could not be given back, asking about cancellations without notifications). The
loop runs while ``busy()`` says there is something to keep, and starts again on ``start()``.

The loop never dies of what ``beat`` or ``between`` raises: each logs its own database
failures (StorageError), and anything else is logged here; either way the loop goes on, at
its pace, as if that call had done nothing (a lease that a dead loop stopped renewing would
expire under its running turn, and one it stopped giving back would hold its conversation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("turnstore.heartbeat")


class Heartbeat:
    def __init__(
        self,
        every_s: float,
        beat: Callable[[], Awaitable[None]],
        busy: Callable[[], bool],
        *,
        between: Callable[[], Awaitable[None]] | None = None,
        poll_s: Callable[[], float | None] = lambda: None,
        beat_first: bool = False,
    ) -> None:
        self._every_s = every_s
        self._beat = beat
        self._busy = busy
        self._between = between
        self._poll_s = poll_s  # how soon ``between`` is wanted now (None: not before a beat)
        self._beat_first = beat_first  # beat as soon as the loop starts
        self._task: asyncio.Task[None] | None = None
        self._woken = asyncio.Event()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        """Run ``between`` now (and start the loop if it is not running)."""
        self._woken.set()
        self.start()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        beat_at = time.monotonic() + (0 if self._beat_first else self._every_s)
        while self._busy():
            if self._between is not None:
                await _survived(self._between)
            if time.monotonic() >= beat_at:
                await _survived(self._beat)
                beat_at = time.monotonic() + self._every_s
            wait = beat_at - time.monotonic()
            poll = self._poll_s()
            self._woken.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(min(wait, poll) if poll else wait, 0.01)):
                    await self._woken.wait()


async def _survived(call: Callable[[], Awaitable[None]]) -> None:
    """``call()``; what it raises (but a cancellation) is logged, not raised."""
    try:
        await call()
    except Exception:
        log.exception("a background renewal failed; the loop goes on")
