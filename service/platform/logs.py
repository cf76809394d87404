"""Structured logs: one JSON object per line, each with the request's correlation id.

Log records carry ids, codes and timings only: never message text, provider bodies or
secrets (nothing in turnstore logs them; keep it that way).
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from contextvars import ContextVar
from typing import Any

import msgspec
from opentelemetry import trace

from service.platform import tracing

correlation_id_var: ContextVar[str | None] = ContextVar("correlation_id", default=None)


_ENCODE = msgspec.json.Encoder().encode
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class JSONFormatter(logging.Formatter):
    """One JSON object per record. Every request writes one (the access log): the second's
    text is made once per second, the trace is looked up only while tracing is on, and the
    line is encoded by msgspec."""

    _second = -1
    _stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        entry: dict[str, Any] = {
            "ts": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "correlation_id": getattr(record, "correlation_id", None) or correlation_id_var.get(),
        }
        for key in record.__dict__.keys() - _STANDARD:  # what a call passed with extra=...
            if key not in entry:
                value = record.__dict__[key]
                entry[key] = (
                    value if isinstance(value, str | int | float | bool | None) else str(value)
                )
        if tracing.active():
            span = trace.get_current_span().get_span_context()
            if span.is_valid:  # the line joins its trace
                entry["trace_id"] = f"{span.trace_id:032x}"
                entry["span_id"] = f"{span.span_id:016x}"
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        try:
            return _ENCODE(entry).decode()
        except (msgspec.EncodeError, UnicodeEncodeError):  # a lone surrogate: the stdlib writes it
            return json.dumps(entry, ensure_ascii=False)


def configure(log_format: str = "json", level: str = "INFO") -> dict[str, Any]:
    """Configure logging for this process; the returned dict also serves as uvicorn's
    ``log_config`` so its access and error lines are JSON with the correlation id too."""
    formatter: dict[str, Any] = (
        {"()": JSONFormatter}
        if log_format == "json"
        else {"format": "%(levelname)s %(name)s: %(message)s"}
    )
    config: dict[str, Any] = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "default"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            **{
                name: {"handlers": ["stderr"], "level": level, "propagate": False}
                for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
            },
            # httpx logs every request line at INFO: provider URLs stay out of the logs.
            "httpx": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
        },
    }
    logging.config.dictConfig(config)
    # No line says where in the source it was logged: finding that walks the stack for every
    # record (the logging documentation's "Optimization" section).
    logging._srcfile = None
    return config
