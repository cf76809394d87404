"""tests/contracts/chat.py over PostgreSQL."""

from __future__ import annotations

from tests.contracts.chat import *  # noqa: F403
