"""tests/contracts/v1_real_shapes.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.v1_real_shapes import *  # noqa: F403
