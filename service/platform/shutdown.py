"""The process was told to stop: a flag that open streams watch.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits, up to its grace period,
for the open requests to finish; only then does the application's lifespan shutdown run. A
Server-Sent Events stream is an open request that may go on for minutes, so it would hold the
process to the end of the grace period and then be cut without a terminal event. The streams
must hear of the signal first: ``shutdown_on_signals`` (entered by the app's lifespan) puts a
handler in front of the server's own that sets ``SHUTDOWN``, and api/sse.py ends every open
stream with an ``error`` event when it is set. Requests that are not streams simply finish.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class ShutdownSignal:
    """Set once per process, by a signal handler or a test; awaitable from any event loop."""

    def __init__(self) -> None:
        self._set = False
        self._waiters: set[asyncio.Future[None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """Safe to call from a signal handler: waiters are woken through their own loop."""
        self._set = True
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            if not self._set:  # checked after registering: a signal may come in between
                await waiter
        finally:
            self._waiters.discard(waiter)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


SHUTDOWN = ShutdownSignal()


@contextmanager
def shutdown_on_signals(
    flag: ShutdownSignal = SHUTDOWN, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> Iterator[None]:
    """While inside, these signals set ``flag`` and then go on to the handler that was there
    before (uvicorn's, which starts the graceful shutdown). Outside the main thread, where
    Python cannot handle signals, this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    flag.clear()  # a new server in this process has not been told to stop yet
    previous = {sig: old for sig in signals if (old := signal.getsignal(sig)) is not None}

    def handler(signum: int, frame: FrameType | None) -> None:
        flag.set()
        chained = previous[signum]
        if callable(chained):
            chained(signum, frame)
        elif chained == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, chained in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, chained)
