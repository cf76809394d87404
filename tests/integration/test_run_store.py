"""The run-store contract (tests/contracts/run_store.py) over PostgreSQL, in clear and
encrypted."""

from __future__ import annotations

from tests.contracts.run_store import *  # noqa: F403

BACKENDS = ("postgres", "postgres-encrypted")
