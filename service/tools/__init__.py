"""Server-side read-only tools: the registry (``registry``), the gate (``gate``) and the
executor it admits calls to (``executor``), examples (``lookup``). Tool authors need only
``cancel_requested``; turnstore wires the rest."""

from service.core.model import MAX_ARGUMENT_CHARS, ToolCallRecord, ToolStatus
from service.tools.executor import ToolExecutor, cancel_requested
from service.tools.gate import MAX_RESULT_CHARS, ToolGate
from service.tools.registry import Tool, ToolRegistry

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
