"""tests/contracts/v1_requests.py over PostgreSQL: the app served in-process on the test database."""

from __future__ import annotations

from tests.contracts.v1_requests import *  # noqa: F403
