"""tests/contracts/forks.py over PostgreSQL: the app served in-process on the test database."""

from __future__ import annotations

from tests.contracts.forks import *  # noqa: F403
