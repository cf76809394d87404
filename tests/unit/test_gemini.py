"""tests/contracts/gemini.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.gemini import *  # noqa: F403
