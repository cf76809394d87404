"""HTTP request metrics: requests by route template (never the raw path: ids would explode the
series), method and status, and their duration (for a stream, until its last byte). Observed
by the edge (service/api/edge.py) for every request: one no route matched (404, 405), or one
the request rules refused before routing, is counted under ``unmatched``."""

from __future__ import annotations

from service.platform.metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS, series

UNMATCHED = "unmatched"


def observe(route: str, method: str, status: int, seconds: float) -> None:
    series(HTTP_REQUESTS, route, method, str(status)).inc()
    series(HTTP_REQUEST_SECONDS, route, method).observe(seconds)
