"""Strict JSON: one value, no duplicate object keys, no trailing content.

msgspec (and the stdlib by default) keep the last of duplicate keys silently; a request
with ``{"message": "a", "message": "b"}`` is ambiguous, so it is rejected instead.
"""

from __future__ import annotations

import json
from typing import Any


class StrictJSONError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise StrictJSONError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def loads(raw: str | bytes) -> Any:
    """Parse ``raw`` or raise StrictJSONError with a message safe to show a client."""
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except StrictJSONError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise StrictJSONError("malformed JSON") from exc
