"""X-Correlation-Id: reuse a safe client value or make one, on every response (sent by the
edge, service/api/edge.py)."""

from __future__ import annotations

import re
import uuid

from litestar.types import Scope

_SAFE = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}")
_STATE_KEY = "correlation_id"


def correlation_id(scope: Scope) -> str:
    """The request's correlation id, decided once per request and kept in its scope."""
    state = scope.setdefault("state", {})
    cid = state.get(_STATE_KEY)
    if cid is None:
        sent = next((v for k, v in scope.get("headers", ()) if k == b"x-correlation-id"), b"")
        text = sent.decode("latin-1")
        cid = text if _SAFE.fullmatch(text) else uuid.uuid4().hex
        state[_STATE_KEY] = cid
    return str(cid)
