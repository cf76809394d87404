"""tests/contracts/v1_responses.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.v1_responses import *  # noqa: F403
