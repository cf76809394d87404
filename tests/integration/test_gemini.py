"""tests/contracts/gemini.py over PostgreSQL."""

from __future__ import annotations

from tests.contracts.gemini import *  # noqa: F403
