"""The gate every tool call of the model goes through, in the contract's order:

size -> strict JSON -> registry -> schema -> per-turn budget -> worker admission -> timed wait
-> result check. Each step returns a status when it refuses, so no step can be skipped, and
every status becomes a ``function_call_output`` for the model: the turn goes on. No retries.

A result over ``MAX_RESULT_CHARS`` goes to the model as its first ``MAX_RESULT_CHARS``
characters with ``"truncated": true``, so the model knows it did not see all of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from service.core.model import MAX_ARGUMENT_CHARS, ToolCallRecord, ToolStatus
from service.core.strictjson import StrictJSONError, is_encodable, loads
from service.tools.executor import ToolExecutor, run_cancellable
from service.tools.registry import Tool, ToolRegistry

MAX_RESULT_CHARS = 8192
RECORDED_NAME_CHARS = 200  # a valid name has at most 64; the model may propose anything

logger = logging.getLogger("turnstore.tools")


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
        truncated = result is not None and len(result) > MAX_RESULT_CHARS
        return ToolCallRecord(
            call_id=call_id,
            name=_clip(name, RECORDED_NAME_CHARS),
            arguments=_clip(arguments, MAX_ARGUMENT_CHARS),
            accepted=not isinstance(checked, ToolStatus),
            status=status,
            result=result[:MAX_RESULT_CHARS] if result is not None else None,
            duration_ms=(time.perf_counter() - started) * 1000,
            truncated=truncated,
        )

    def _check(self, name: str, arguments: str) -> tuple[Tool, dict[str, Any]] | ToolStatus:
        """Size, strict JSON, registry, schema: whether the proposal is acceptable at all."""
        if len(arguments) > MAX_ARGUMENT_CHARS:
            return ToolStatus.INVALID
        try:
            parsed = loads(arguments)
        except StrictJSONError:
            return ToolStatus.INVALID
        # Lone surrogates (valid JSON escapes) are no text a tool or the database can take.
        if not isinstance(parsed, dict) or not is_encodable(json.dumps(parsed, ensure_ascii=False)):
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
    elif not is_encodable(value):
        problem = "returned text that is not valid Unicode (lone surrogates)"
    else:
        return ToolStatus.OK, value
    logger.warning("tool %s call %s %s", name, call_id, problem)
    return ToolStatus.TOOL_ERROR, None


def _clip(text: str, limit: int) -> str:
    """``text`` if it fits, else a prefix and a marker, ``limit`` characters in all."""
    if len(text) <= limit:
        return text
    marker = f"…[{len(text)} characters]"
    return text[: limit - len(marker)] + marker
