"""The gate every tool call of the model goes through, in the contract's order:

size -> strict JSON -> registry -> schema -> per-turn budget -> worker admission -> timed wait
-> result check. Each step returns a status when it refuses, so no step can be skipped, and
every status becomes a ``function_call_output`` for the model: the turn goes on. No retries.

Results over ``MAX_RESULT_CHARS`` are refused (``TOOL_ERROR``), not truncated: a cut-off
answer looks complete to the model, which may then state it as fact; a refusal it can explain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from service.strictjson import StrictJSONError, is_encodable, loads
from service.tools.base import Tool, ToolRegistry, run_cancellable

MAX_ARGUMENT_CHARS = 4096
MAX_RESULT_CHARS = 8192
RECORDED_NAME_CHARS = 200  # a valid name has at most 64; the model may propose anything

logger = logging.getLogger("turnstore.tools")
T = TypeVar("T")


class ToolStatus(StrEnum):
    OK = "OK"
    INVALID = "INVALID"
    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    BUSY = "BUSY"
    BUDGET = "BUDGET"
    NOT_FOUND = "NOT_FOUND"
    TIMEOUT = "TIMEOUT"
    TOOL_ERROR = "TOOL_ERROR"


@dataclass(frozen=True)
class ToolCallRecord:
    """One call as proposed and as decided. ``name`` and ``arguments`` are clipped to
    RECORDED_NAME_CHARS and MAX_ARGUMENT_CHARS (a marker tells the original length), so a
    record is bounded whatever the model sent; ``result`` is set for OK only."""

    call_id: str
    name: str
    arguments: str
    accepted: bool  # passed size, strict JSON, registry and schema
    status: ToolStatus
    result: str | None
    duration_ms: float  # in the gate, from the call to its record

    def output(self) -> str:
        """The ``output`` of the function_call_output item sent back to the model."""
        result = self.result if self.status is ToolStatus.OK else None
        return json.dumps({"status": str(self.status), "result": result}, ensure_ascii=False)


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


class ToolGate:
    """One per turn: the per-turn budget lives here."""

    def __init__(
        self, registry: ToolRegistry, executor: ToolExecutor, *, budget: int, timeout_s: float
    ) -> None:
        if budget < 0 or timeout_s <= 0:
            raise ValueError("budget must be >= 0 and timeout_s > 0")
        self._registry = registry
        self._executor = executor
        self._budget = budget
        self._timeout_s = timeout_s
        self._admitted = 0  # calls that reached a worker: only these consume the budget

    async def call(self, call_id: str, name: str, arguments: str) -> ToolCallRecord:
        started = time.perf_counter()
        checked = self._check(name, arguments)
        if isinstance(checked, ToolStatus):
            status, result = checked, None
        else:
            status, result = await self._execute(call_id, *checked)
        return ToolCallRecord(
            call_id=call_id,
            name=_clip(name, RECORDED_NAME_CHARS),
            arguments=_clip(arguments, MAX_ARGUMENT_CHARS),
            accepted=not isinstance(checked, ToolStatus),
            status=status,
            result=result,
            duration_ms=(time.perf_counter() - started) * 1000,
        )

    def _check(self, name: str, arguments: str) -> tuple[Tool, dict[str, Any]] | ToolStatus:
        """Size, strict JSON, registry, schema: whether the proposal is acceptable at all."""
        if len(arguments) > MAX_ARGUMENT_CHARS:
            return ToolStatus.INVALID
        try:
            parsed = loads(arguments)
        except StrictJSONError:
            return ToolStatus.INVALID
        if not isinstance(parsed, dict) or _has_non_finite(parsed):
            return ToolStatus.INVALID
        tool = self._registry.get(name)
        if tool is None:
            return ToolStatus.UNKNOWN_TOOL
        if not self._registry.arguments_valid(name, parsed):
            return ToolStatus.INVALID
        return tool, parsed

    async def _execute(
        self, call_id: str, tool: Tool, arguments: dict[str, Any]
    ) -> tuple[ToolStatus, str | None]:
        """Budget, admission, the timed wait and the result check."""
        # No await between the budget check and the admission: the count stays exact even if
        # a caller ran calls of one turn concurrently.
        if self._admitted >= self._budget:
            return ToolStatus.BUDGET, None
        cancel = threading.Event()
        future = self._executor.try_start(
            lambda: run_cancellable(cancel, lambda: _run_logged(tool, call_id, arguments))
        )
        if future is None:
            return ToolStatus.BUSY, None
        self._admitted += 1
        try:
            await asyncio.wait({future}, timeout=self._timeout_s)
        finally:
            if not future.done():  # timed out, or this turn was cancelled while waiting
                cancel.set()
                future.cancel()
        if future.cancelled():
            logger.warning(
                "tool %s call %s: no result after %.3g s; cancellation requested, its worker "
                "stays busy until the tool returns",
                tool.name,
                call_id,
                self._timeout_s,
            )
            return ToolStatus.TIMEOUT, None
        if future.exception() is not None:
            return ToolStatus.TOOL_ERROR, None  # already logged on the worker
        return _judge(tool.name, call_id, future.result())


def _run_logged(tool: Tool, call_id: str, arguments: dict[str, Any]) -> object:
    try:
        return tool.run(arguments)
    except BaseException:
        # The text stays in this process: the model and the client only see TOOL_ERROR.
        # The arguments are not logged: they are the model's, possibly the user's, text.
        logger.warning("tool %s call %s raised", tool.name, call_id, exc_info=True)
        raise


def _judge(name: str, call_id: str, value: object) -> tuple[ToolStatus, str | None]:
    """What a returned value means; every refusal is the tool's bug, logged for its owner."""
    if value is None:
        return ToolStatus.NOT_FOUND, None
    if not isinstance(value, str):
        problem = f"returned {type(value).__name__}, not str"
    elif len(value) > MAX_RESULT_CHARS:
        problem = f"returned {len(value)} characters, over the cap of {MAX_RESULT_CHARS}"
    elif not is_encodable(value):
        problem = "returned text that is not valid Unicode (lone surrogates)"
    else:
        return ToolStatus.OK, value
    logger.warning("tool %s call %s %s", name, call_id, problem)
    return ToolStatus.TOOL_ERROR, None


def _has_non_finite(value: Any) -> bool:
    """NaN and Infinity are Python's extensions, not JSON (strictjson lets them through).
    Iterative: the input may be nested as deep as the parser allowed."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _clip(text: str, limit: int) -> str:
    """``text`` if it fits, else a prefix and a marker, ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    marker = f"…[{len(text)} characters]"
    return text[: limit - len(marker)] + marker
