"""tests/contracts/claude.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.claude import *  # noqa: F403
