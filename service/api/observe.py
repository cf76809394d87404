"""HTTP request metrics: requests by route template (never the raw path: ids would explode the
series), method and status, and their duration (for a stream, until its last byte). Observed
by the edge (service/api/edge.py) for every request: one no route matched (404, 405), or one
the request rules refused before routing, is counted under ``unmatched``."""

from __future__ import annotations

from prometheus_client.metrics import Counter, Histogram

from service.platform.metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS

UNMATCHED = "unmatched"

# The labelled series already used: ``labels()`` takes a lock and builds its key each call.
_counters: dict[tuple[str, str, int], Counter] = {}
_timers: dict[tuple[str, str], Histogram] = {}


def observe(route: str, method: str, status: int, seconds: float) -> None:
    counter = _counters.get((route, method, status))
    if counter is None:
        counter = _counters[route, method, status] = HTTP_REQUESTS.labels(
            route, method, str(status)
        )
    timer = _timers.get((route, method))
    if timer is None:
        timer = _timers[route, method] = HTTP_REQUEST_SECONDS.labels(route, method)
    counter.inc()
    timer.observe(seconds)
