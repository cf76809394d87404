"""Prometheus metrics of the turn loop (one registry per process; scrape each replica)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from service.core.errors import TurnstoreError
from service.core.usage import Usage

M = TypeVar("M", Counter, Gauge, Histogram)
_series: dict[tuple[object, ...], object] = {}


def series(metric: M, *labels: str) -> M:
    """``metric.labels(*labels)``, remembered: prometheus_client takes a lock and builds the
    key on every call, and every request and turn counts a few of them."""
    key = (metric, *labels)
    found = _series.get(key)
    if found is None:
        found = _series[key] = metric.labels(*labels)
    return found  # type: ignore[return-value]


REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)  # CPU, memory, open files of this process
PlatformCollector(registry=REGISTRY)

HTTP_REQUESTS = Counter(
    "turnstore_http_requests_total",
    "HTTP requests by route template, method and status.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
HTTP_REQUEST_SECONDS = Histogram(
    "turnstore_http_request_seconds",
    "HTTP request duration by route template and method (a stream: to its last byte).",
    ["route", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)

TURNS_COMMITTED = Counter(
    "turnstore_turns_committed_total", "Turns committed.", ["mode"], registry=REGISTRY
)
PROVIDER_RETRIES = Counter(
    "turnstore_provider_retries_total",
    "Provider calls made again without earlier turns' opaque content (sealed reasoning, signed "
    "thinking) after the provider refused it, by model: the one retry a turn makes.",
    ["model"],
    registry=REGISTRY,
)
TURNS_NOT_COMMITTED = Counter(
    "turnstore_turns_not_committed_total",
    "Turns that ended without a commit, by reason (an error code, or disconnect).",
    ["mode", "reason"],
    registry=REGISTRY,
)
PROVIDER_TOKENS = Counter(
    "turnstore_provider_tokens_total",
    "Tokens the provider reported for its calls (usage), by model and kind: input, cached "
    "(of the input), output, reasoning (of the output).",
    ["model", "kind"],
    registry=REGISTRY,
)


def tokens_used(model: str, usage: Usage) -> None:
    """Count one provider call's usage."""
    for kind, count in (
        ("input", usage.input_tokens), ("cached", usage.cached_tokens),
        ("output", usage.output_tokens), ("reasoning", usage.reasoning_tokens),
    ):  # fmt: skip
        if count:
            series(PROVIDER_TOKENS, model, kind).inc(count)


PROVIDER_SECONDS = Histogram(
    "turnstore_provider_seconds",
    "Time from the provider request to its final reply.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 90),
    registry=REGISTRY,
)
COMMIT_SECONDS = Histogram(
    "turnstore_commit_seconds",
    "Time of the turn-commit transaction.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
    registry=REGISTRY,
)
TURNS_BUSY = Counter(
    "turnstore_turns_busy_total",
    "Turns refused with conversation_busy: another turn of the conversation held its lease.",
    registry=REGISTRY,
)
TURNS_QUEUED = Counter(
    "turnstore_turns_queued_total",
    "Turns that waited for their conversation's lease (TURN_CONCURRENCY=queue).",
    registry=REGISTRY,
)
QUEUE_WAIT_SECONDS = Histogram(
    "turnstore_turn_queue_wait_seconds",
    "How long a queued turn waited for its conversation's lease.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
TURNS_WAITING = Gauge(
    "turnstore_turns_waiting",
    "Turns waiting for their conversation's lease now.",
    registry=REGISTRY,
)
OPEN_STREAMS = Gauge("turnstore_open_streams", "SSE streams open now.", registry=REGISTRY)
POOL_IN_USE = Gauge(
    "turnstore_db_pool_in_use", "Database connections checked out now.", registry=REGISTRY
)


def turn_ended(mode: str, *, committed: bool) -> None:
    """A turn reached its end: committed, or refused by the content filter."""
    if committed:
        series(TURNS_COMMITTED, mode).inc()
    else:
        series(TURNS_NOT_COMMITTED, mode, "content_filtered").inc()


@contextmanager
def turn_outcome(mode: str) -> Iterator[None]:
    """Count a turn that ends without a commit by why it ended (commits are counted where
    they happen)."""
    try:
        yield
    except TurnstoreError as exc:
        series(TURNS_NOT_COMMITTED, mode, exc.code).inc()
        raise
    except (GeneratorExit, asyncio.CancelledError):
        series(TURNS_NOT_COMMITTED, mode, "disconnect").inc()
        raise
    except Exception:
        series(TURNS_NOT_COMMITTED, mode, "internal_error").inc()
        raise
