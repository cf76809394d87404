"""How `turnstore serve` runs uvicorn: with a bound on the request head the app never sees.

h11 bounds it by itself (``h11_max_incomplete_event_size``: at most that much of a head still
arriving is buffered, then 400). uvicorn's httptools protocol, faster and used when httptools
is installed, has no bound at all: a client could send megabytes of headers. The subclass
below gives it h11's rule. Either way a head that arrives whole in one read (up to 256 KiB)
still reaches the app, whose middleware (service/api/limits.py) then answers 400 in the
envelope.
"""

from __future__ import annotations

from typing import Any

from service.api.limits import MAX_HEAD_BYTES

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover (httptools is a dependency; h11 is the fallback)
    HTTP_LIMITS: dict[str, Any] = {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
else:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """Refuses (400, connection closed) a request head still incomplete after
        MAX_HEAD_BYTES, counted over the reads since the request began."""

        _head_open = False
        _head_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._head_open = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_open:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._head_open = False
                    self.send_400_response("Request header fields too large.")

    HTTP_LIMITS = {
        "http": BoundedHttpToolsProtocol,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
