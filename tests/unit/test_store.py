"""The store contract (tests/contracts/store.py) over the in-memory fake."""

from __future__ import annotations

from tests.contracts.store import *  # noqa: F403

BACKENDS = ("memory",)
