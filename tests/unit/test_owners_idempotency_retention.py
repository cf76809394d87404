"""tests/contracts/owners_idempotency_retention.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.owners_idempotency_retention import *  # noqa: F403
