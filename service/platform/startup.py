"""Which database a process starts on, and whether start-up migrates it: DATABASE_URL as it
is (migrated only by `turnstore db upgrade`, a step of its own before the replicas start), or
the embedded server under TURNSTORE_DATA_DIR, started on first use and migrated here (the
zero-configuration default of `make run`). Connecting to it is platform/db.py's."""

from __future__ import annotations

from collections.abc import Callable

from service.platform.embedded import ensure_embedded_postgres
from service.platform.migrate import upgrade
from service.platform.settings import Settings


def resolve_database(settings: Settings, *, migrate: bool = True) -> tuple[str, Callable[[], None]]:
    """DATABASE_URL, or the embedded server under the data dir (started on first use, and
    migrated when ``migrate``: only the embedded database is migrated automatically).
    Returns the URL and what to call at shutdown (stops the server if this call started it)."""
    if settings.database_url:
        return settings.database_url, lambda: None
    server = ensure_embedded_postgres(settings.data_dir)
    if migrate:
        upgrade(server.url)
    return server.url, server.stop
