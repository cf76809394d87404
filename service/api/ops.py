"""Liveness and readiness."""

from __future__ import annotations

from litestar import Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import Ops
from service.api.errors import documented
from service.core.errors import NotReady, StorageError
from service.platform.metrics import POOL_IN_USE, REGISTRY
from service.platform.migrate import head_revision, known_revisions
from service.platform.shutdown import SHUTDOWN

_HEAD = head_revision()
_KNOWN = known_revisions()


@get("/healthz", tags=["operations"], summary="The process is alive.")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics of this process.",
    media_type="text/plain; version=0.0.4; charset=utf-8",
)
async def metrics(ops: Ops) -> Response[bytes]:
    POOL_IN_USE.set(ops.pool_in_use())
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


@get(
    "/readyz",
    tags=["operations"],
    summary="The database is reachable and its schema is at the migration head.",
    responses=documented(NotReady),
)
async def readyz(ops: Ops) -> dict[str, str]:
    if SHUTDOWN.is_set():  # draining: the load balancer should stop sending new work here
        raise NotReady("This replica is shutting down.")
    try:
        readiness = await ops.readiness()
    except StorageError:
        raise NotReady("The database is not reachable.") from None
    if not readiness.writable:
        raise NotReady("The database is read-only (in recovery, or set read-only).")
    if not readiness.keyring:
        raise NotReady("The keyring (KEYRING_DATABASE_URL) is not reachable or not migrated.")
    current = readiness.schema
    # Ready at this release's head, or at a newer one it does not know: during a rolling
    # upgrade the old pods keep serving after the new release migrated (expand/contract).
    if current is None or (current != _HEAD and current in _KNOWN):
        raise NotReady(f"The database schema is at {current or 'nothing'}, not at {_HEAD}.")
    return {"status": "ready", "schema": current or ""}
