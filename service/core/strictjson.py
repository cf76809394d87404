"""Strict JSON: one value, no duplicate object keys, no trailing content, nothing that is not
JSON (NaN, Infinity, numbers too large for a float), and at most MAX_DEPTH levels of nesting.

msgspec (and the stdlib by default) keep the last of duplicate keys silently; a request
with ``{"message": "a", "message": "b"}`` is ambiguous, so it is rejected instead. The
stdlib also accepts ``NaN`` and ``Infinity`` and turns ``1e999`` into ``inf``; none of them is
JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 32  # far beyond any request or tool arguments turnstore expects


class StrictJSONError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise StrictJSONError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise StrictJSONError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StrictJSONError("a number is out of range")
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest


# Built once (``json.loads`` with hooks builds a decoder and its scanner on every call).
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite
)


def loads(raw: str | bytes) -> Any:
    """Parse ``raw`` or raise StrictJSONError with a message safe to show a client. Bytes and
    a byte order mark are taken as ``json.loads`` takes them."""
    try:
        if isinstance(raw, str):
            if raw.startswith("\ufeff"):
                raise ValueError("a byte order mark")
            text = raw
        else:
            text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        value = _DECODER.decode(text)
    except StrictJSONError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise StrictJSONError("malformed JSON") from exc
    if _depth(value) > MAX_DEPTH:
        raise StrictJSONError(f"nested deeper than {MAX_DEPTH} levels")
    return value


def is_encodable(text: str) -> bool:
    """False for lone surrogates: JSON escapes allow them, but no provider can be sent them
    and PostgreSQL cannot store them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def holds_nul(value: Any) -> bool:
    """Whether a decoded JSON value holds a NUL character in any string or key: what is
    stored is refused with it (PostgreSQL's text cannot hold it, and it is never meant)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False
