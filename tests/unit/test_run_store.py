"""The run-store contract (tests/contracts/run_store.py) over the in-memory fake."""

from __future__ import annotations

from tests.contracts.run_store import *  # noqa: F403

BACKENDS = ("memory",)
