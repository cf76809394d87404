"""Server-side read-only tools: the registry (``base``), the gate (``gate``), examples
(``lookup``). Tool authors need only ``cancel_requested``; turnstore wires the rest."""

from service.tools.base import Tool, ToolRegistry, cancel_requested
from service.tools.gate import (
    MAX_ARGUMENT_CHARS,
    MAX_RESULT_CHARS,
    ToolCallRecord,
    ToolExecutor,
    ToolGate,
    ToolStatus,
)

__all__ = [
    "MAX_ARGUMENT_CHARS",
    "MAX_RESULT_CHARS",
    "Tool",
    "ToolCallRecord",
    "ToolExecutor",
    "ToolGate",
    "ToolRegistry",
    "ToolStatus",
    "cancel_requested",
]
