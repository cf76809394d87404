"""Test tools for the gate: each one exercises one way a tool can behave.

Tools that block take a ``threading.Event`` the test sets; every wait is bounded, so a failing
test cannot leave a thread behind for long.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from service.tools import cancel_requested

SECRET = "hunter2-db-password"
BOUND_S = 10.0  # the longest any test tool blocks when a test forgets to release it


class Echo:
    """Returns its text; counts its runs. The nested object has no additionalProperties."""

    name = "echo"
    description = "Echo a text."

    def __init__(self) -> None:
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "text": {"type": "string", "maxLength": 100},
                "options": {"type": "object", "properties": {"upper": {"type": "boolean"}}},
            },
            "required": ["text"],
        }
        self.runs = 0

    def run(self, arguments: dict[str, Any]) -> str | None:
        self.runs += 1
        upper = arguments.get("options", {}).get("upper", False)
        text: str = arguments["text"]
        return text.upper() if upper else text


class Returns:
    """Returns whatever it was built with, whatever the arguments: None, too long, not a str."""

    description = "Return a fixed value."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def run(self, arguments: dict[str, Any]) -> Any:
        return self.value


class Explodes:
    """Raises with a secret in the message: it must reach the log only."""

    name = "explode"
    description = "Always fails."
    parameters: dict[str, Any] = {"type": "object", "properties": {"note": {"type": "string"}}}  # noqa: RUF012

    def run(self, arguments: dict[str, Any]) -> str | None:
        raise RuntimeError(f"cannot connect with password {SECRET}")


class Stubborn:
    """Ignores cancellation: blocks until ``release`` is set, then makes its side effect."""

    name = "stubborn"
    description = "Blocks until released."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.side_effects = 0
        self.cancel_seen_at_end: bool | None = None
        self._lock = threading.Lock()

    def run(self, arguments: dict[str, Any]) -> str | None:
        self.started.set()
        self.release.wait(BOUND_S)
        with self._lock:
            self.side_effects += 1
        self.cancel_seen_at_end = cancel_requested()
        self.finished.set()
        return "done"


class Cooperative:
    """Checks cancel_requested() and stops early when asked; finishes when released."""

    name = "cooperative"
    description = "Stops when turnstore stops waiting."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.stopped_early = threading.Event()

    def run(self, arguments: dict[str, Any]) -> str | None:
        self.started.set()
        deadline = time.monotonic() + BOUND_S
        # cancel_requested() is a poll: a long-running tool checks it between units of work.
        while time.monotonic() < deadline and not self.release.wait(0.005):
            if cancel_requested():
                self.stopped_early.set()
                return None
        return "finished"


echo = Echo()
explode = Explodes()


class _BadName:
    name = "Bad Name"
    description = "A name the registry refuses."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}  # noqa: RUF012

    def run(self, arguments: dict[str, Any]) -> str | None:
        return None


class _StringSchema(_BadName):
    name = "stringly"
    parameters: dict[str, Any] = {"type": "string"}  # noqa: RUF012


class _BrokenSchema(_BadName):
    name = "broken"
    parameters: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "strnig"}}}  # noqa: RUF012


bad_name = _BadName()
string_schema = _StringSchema()
broken_schema = _BrokenSchema()
not_a_tool = object()
