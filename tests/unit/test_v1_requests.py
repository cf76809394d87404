"""tests/contracts/v1_requests.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.v1_requests import *  # noqa: F403
