"""Everything the store bench compares, behind one interface: a turn reads the whole history
and appends the new turn. Peers are imported only when opened, so one that cannot be
installed is reported and skipped."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Protocol
from uuid import UUID

from bench.workload import Payload


class Subject(Protocol):
    name: str
    tables: tuple[str, ...]  # what its stored bytes are measured on

    async def turn(self, conversation: UUID, payload: Payload, history: int) -> None:
        """Read the whole history (``history`` earlier turns, checked) and append a turn."""

    async def close(self) -> None: ...


Opener = Callable[[str], Awaitable[Subject]]

# label -> (module, opener function); the first is the subject the targets are about.
SUBJECTS: dict[str, tuple[str, str]] = {
    "turnstore": ("bench.stores.turnstore", "open_cached"),
    "turnstore-encrypted": ("bench.stores.turnstore", "open_encrypted"),
    "turnstore-nocache": ("bench.stores.turnstore", "open_uncached"),
    "asyncpg-baseline": ("bench.stores.baseline", "open_baseline"),
    "agents-sqlalchemy": ("bench.stores.agents", "open_agents"),
    "langchain-postgres": ("bench.stores.langchain", "open_langchain"),
    "langgraph": ("bench.stores.langgraph", "open_langgraph"),
}


def opener(label: str) -> Opener:
    module, function = SUBJECTS[label]
    found: Opener = getattr(importlib.import_module(module), function)
    return found
