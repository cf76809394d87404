"""tests/contracts/openai_sdk.py over the in-memory backend: the app served in-process, no database."""

from __future__ import annotations

from tests.contracts.openai_sdk import *  # noqa: F403
