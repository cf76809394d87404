"""Checks every request passes before any route sees it, and a bound on every send (both
applied by the edge, service/api/edge.py).

- The request head (target plus headers) has a hard size limit, whatever the ASGI server:
  uvicorn's h11 ``max_incomplete_event_size`` bounds what it buffers of a head still arriving,
  but a head that arrives in one read (up to 256 KiB on loopback) is parsed whatever its size.
- A request with a body to a path some route serves must say it is JSON (``Content-Type:
  application/json``, or ``application/x-ndjson`` to the import): a web page can post
  ``text/plain`` to any address without asking first, but not JSON (that needs a CORS
  preflight, which turnstore never grants). A path no route serves is the router's 404,
  whatever the body.
- With AUTH_MODE=none, only loopback names (and ALLOWED_HOSTS) are accepted in ``Host``: a
  page that rebinds its own DNS name to 127.0.0.1 still sends its own name.
- A response whose client stops reading fails after ``send_timeout_s`` (the stream then ends
  as on a disconnect), instead of holding its turn and the conversation for good.

Each refusal is answered in the contract's envelope by the app's exception handler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from litestar.types import Scope
from litestar.utils import normalize_path

from service.core.errors import InvalidHost, InvalidInput, UnsupportedMediaType

MAX_HEAD_BYTES = 16 * 1024  # room for a large JWT
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# Probes and scrapers address a pod by its IP: no data behind these, whatever the Host.
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(frozen=True)
class RequestRules:
    allowed_hosts: frozenset[str] | None  # None: any Host (authentication is on, or "*")
    send_timeout_s: float
    # The paths some route serves (``served``): a body sent to another is answered 404 by the
    # router, whatever its content type. None: every path is taken as served.
    routes: re.Pattern[str] | None = None

    def served(self, path: str) -> bool:
        """Whether the router would take ``path`` (normalized as it does it: a trailing or a
        doubled slash names the same route)."""
        return self.routes is None or self.routes.fullmatch(normalize_path(path)) is not None


def route_pattern(paths: Iterable[str]) -> re.Pattern[str]:
    """One pattern for Litestar route paths (``/v1/x/{name:str}``, ``{rest:path}``)."""

    def one(path: str) -> str:
        parts = re.split(r"(\{[^}]*\})", path)
        return "".join(
            (".+" if part.endswith(":path}") else "[^/]+")
            if part.startswith("{")
            else re.escape(part)
            for part in parts
        )

    return re.compile("|".join(f"(?:{one(path)})" for path in sorted(set(paths))))


class ClientStoppedReading(Exception):
    """A send did not complete in time: the client is not reading what it asked for."""


def head_bytes(scope: Scope) -> int:
    target = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
    return target + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def host_name(value: str) -> str:
    """The name of a Host header value, without port or a trailing dot, lower-cased."""
    name = value.rsplit(":", 1)[0] if value.count(":") == 1 or "]:" in value else value
    return name.rstrip(".").lower()


def check(scope: Scope, rules: RequestRules) -> None:
    if head_bytes(scope) > MAX_HEAD_BYTES:
        raise InvalidInput(f"The request's headers exceed {MAX_HEAD_BYTES} bytes.")
    headers = dict(scope["headers"])  # the last of repeated headers: enough for these checks
    host, allowed = headers.get(b"host"), rules.allowed_hosts
    if allowed is not None and host is not None and scope["path"] not in PROBES:
        _check_host(host.decode("latin-1"), allowed)
    has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
    media = headers.get(b"content-type", b"")
    if has_body and not _needs_preflight(media, scope["path"]) and rules.served(scope["path"]):
        raise UnsupportedMediaType()


def _check_host(host: str, allowed: frozenset[str]) -> None:
    if host_name(host) not in allowed:
        raise InvalidHost()


def _needs_preflight(content_type: bytes, path: str) -> bool:
    """JSON, or ndjson to the one route that reads it (an import): neither is a type a page
    may post without a CORS preflight."""
    ndjson = content_type.split(b";", 1)[0].strip().lower() == b"application/x-ndjson"
    return _is_json(content_type) or (ndjson and path.rstrip("/") == NDJSON_PATH)


NDJSON_PATH = "/api/v1/conversations/import"


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def allowed_hosts(auth_mode: str, extra: str | None) -> frozenset[str] | None:
    """The Host names a server accepts: any with authentication on (or ALLOWED_HOSTS=*),
    else the loopback names and ALLOWED_HOSTS."""
    names = {host_name(name.strip()) for name in (extra or "").split(",") if name.strip()}
    if auth_mode != "none" or "*" in names:
        return None
    return LOOPBACK_NAMES | names
