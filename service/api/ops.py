"""Liveness and readiness."""

from __future__ import annotations

from litestar import get
from litestar.openapi.datastructures import ResponseSpec

from service.api.headers import Store
from service.api.schemas import ErrorEnvelope
from service.errors import NotReady, StorageError
from service.migrate import head_revision

_HEAD = head_revision()


@get("/healthz", tags=["operations"], summary="The process is alive.")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get(
    "/readyz",
    tags=["operations"],
    summary="The database is reachable and its schema is at the migration head.",
    responses={503: ResponseSpec(ErrorEnvelope, description="not_ready")},
)
async def readyz(store: Store) -> dict[str, str]:
    try:
        current = await store.schema_revision()
    except StorageError:
        raise NotReady("The database is not reachable.") from None
    if current != _HEAD:
        raise NotReady(f"The database schema is at {current or 'nothing'}, not at {_HEAD}.")
    return {"status": "ready", "schema": current or ""}
