"""tests/contracts/claude.py over PostgreSQL."""

from __future__ import annotations

from tests.contracts.claude import *  # noqa: F403
