"""OpenTelemetry traces: one per request, with spans for the turn's lease, each provider round,
each tool call and the commit. Off unless the standard environment asks for an exporter
(``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``OTEL_TRACES_EXPORTER`` other than ``none``); the OTLP
exporter then reads the rest of the ``OTEL_*`` variables itself. Spans carry ids, counts,
statuses and revisions, never message text, tool arguments or keys."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

tracer = trace.get_tracer("turnstore")
_configured = False
_provider: object = None  # the provider last looked at, and whether it is an SDK one
_sdk = False
_NAMED_IN_ENVIRONMENT = OTEL_PYTHON_TRACER_PROVIDER in os.environ


def active() -> bool:
    """Whether spans go anywhere: an SDK tracer provider is installed (by ``configure``, or by
    a test). Otherwise the API's no-op spans would still cost a context switch each. Asked
    several times per request, so it reads the API's global itself: while none is installed,
    ``get_tracer_provider()`` looks up OTEL_PYTHON_TRACER_PROVIDER in os.environ each call
    (a KeyError raised and caught), 2.8% of a plain turn's server CPU; and the ABC check is
    made once per provider."""
    global _provider, _sdk
    provider = getattr(trace, "_TRACER_PROVIDER", None)
    if provider is None and _NAMED_IN_ENVIRONMENT:  # the API installs it on first use
        provider = trace.get_tracer_provider()
    if provider is not _provider:
        _provider, _sdk = provider, isinstance(provider, TracerProvider)
    return _sdk


def span(name: str, **options: Any) -> AbstractContextManager[trace.Span]:
    """A span of the current trace, or, while tracing is off, a no-op one at no cost."""
    if not active():
        return nullcontext(trace.INVALID_SPAN)
    return tracer.start_as_current_span(name, **options)


def wanted() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "")
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) or exporter not in ("", "none")


def configure() -> None:
    """Install the OTLP exporter once per process, when the environment asks for it."""
    global _configured
    if _configured or not wanted():
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "turnstore")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
