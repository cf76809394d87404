"""What every HTTP provider adapter does alike: map httpx's exception hierarchy and malformed
JSON onto the domain's, pass on a plain Retry-After, and let the provider join the trace.

httpx's hierarchy, mapped in one place (``translated``)::

    httpx.HTTPError
     +-- TimeoutException (Connect/Read/Write/PoolTimeout)   -> UpstreamTimeout
     +-- every other one (ConnectError, ReadError,
         RemoteProtocolError, ProxyError, DecodingError...)  -> UpstreamError
    msgspec.DecodeError, RecursionError (unparsable,
        mis-shaped or absurdly deep JSON)                    -> UpstreamError
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
from opentelemetry import propagate

from service.core.errors import UpstreamError, UpstreamTimeout

# Retry-After as delay-seconds or an IMF-fixdate; anything else is not passed on.
_RETRY_AFTER = re.compile(
    r"\d{1,9}|[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", re.A
)


def retry_after(value: str | None) -> str | None:
    """Pass on a plain Retry-After (delay-seconds or HTTP-date), nothing else."""
    value = (value or "").strip()
    return value if _RETRY_AFTER.fullmatch(value) else None


def trace_headers() -> dict[str, str]:
    """The W3C traceparent of the current span, so the provider may join the trace; nothing
    else of the client's context (its tracestate and baggage stay here)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}


@contextmanager
def translated() -> Iterator[None]:
    """Map httpx's exception hierarchy and malformed JSON onto the domain's."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout() from exc
    except httpx.HTTPError as exc:
        raise UpstreamError("The provider could not be reached or broke off.") from exc
    except (msgspec.DecodeError, RecursionError) as exc:  # malformed, or nested absurdly deep
        raise UpstreamError("The provider answered something unparsable.") from exc
