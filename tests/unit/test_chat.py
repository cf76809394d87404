"""tests/contracts/chat.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.chat import *  # noqa: F403
