"""The process-wide executor that runs tool calls on threads, and how a running tool learns
that nobody waits for it any more."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

# Set by the executor in the context its worker thread runs one call in.
_cancel: ContextVar[threading.Event | None] = ContextVar("turnstore_tool_cancel", default=None)


def cancel_requested() -> bool:
    """For a tool's run(): True once turnstore stopped waiting for this call (TIMEOUT, or the
    turn was abandoned). Tools that check it can stop early; a tool that ignores it keeps its
    worker until it returns. Always False outside a call."""
    event = _cancel.get()
    return event is not None and event.is_set()


def run_cancellable(cancel: threading.Event, work: Callable[[], T]) -> T:
    """Run ``work`` so that cancel_requested() inside it reports ``cancel``. Call it inside a
    context of its own (contextvars.Context.run): the binding is not undone afterwards."""
    _cancel.set(cancel)
    return work()


class ToolExecutor:
    """Process-wide: at most ``workers`` tools run at once; no waiting queue.

    Each admitted call gets a daemon thread of its own, counted as a worker until the tool
    returns, even when nobody waits for it any more. Daemon threads, unlike a
    ThreadPoolExecutor's (joined at interpreter exit), let the process stop while a tool is
    stuck."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self._workers = workers
        self._running = 0
        self._closed = False
        self._changed = threading.Condition()

    @property
    def busy(self) -> int:
        """Workers currently running a tool (including ones nobody waits for any more)."""
        return self._running

    def try_start(self, work: Callable[[], T]) -> asyncio.Future[T] | None:
        """Run ``work`` on a free worker, in a copy of the caller's context; None when no
        worker is free. Once admitted, ``work`` runs to its end: cancelling the returned
        future only stops the waiting (the tool learns of it through cancel_requested())."""
        with self._changed:
            if self._closed or self._running >= self._workers:
                return None
            self._running += 1
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # admitted means run: never skipped silently
        context = contextvars.copy_context()  # the correlation id follows the call into logs
        thread = threading.Thread(target=context.run, args=(self._work, work, future))
        thread.daemon = True
        try:
            thread.start()
        except RuntimeError:  # the OS refused a thread: no worker after all
            self._release()
            return None
        return asyncio.wrap_future(future)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no tool runs (for shutdown reports and tests); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._running == 0, timeout)

    def shutdown(self) -> None:
        """Admit nothing more; tools still running are not waited for."""
        with self._changed:
            self._closed = True

    def _work(self, work: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
        try:
            try:
                value = work()
            finally:
                # Free the worker before the result is seen: its receiver may call again.
                self._release()
        except BaseException as exc:  # nothing else on this thread could catch it
            future.set_exception(exc)
        else:
            future.set_result(value)

    def _release(self) -> None:
        with self._changed:
            self._running -= 1
            self._changed.notify_all()
