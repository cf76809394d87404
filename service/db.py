"""The async engine: one pool per process, recovering by itself after database restarts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from service.settings import Settings


def async_url(url: str) -> str:
    """Accept postgres:// and postgresql:// URLs; always drive them with asyncpg."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed.render_as_string(hide_password=False)


def driver_connect_args(url: str) -> dict[str, Any]:
    """asyncpg.connect() arguments for ``url`` as the engine would connect (several hosts and
    target_session_attrs included), for a connection outside the pool."""
    parsed = make_url(async_url(url))
    _, kwargs = parsed.get_dialect()().create_connect_args(parsed)
    return {**kwargs, "server_settings": {"application_name": "turnstore-listen"}}


def _unnamed() -> str:
    return ""  # the protocol's unnamed statement: it lives until the next Parse, never longer


def create_engine(url: str, *, pool_size: int = 10, statement_cache_size: int = 100) -> AsyncEngine:
    """``statement_cache_size`` sizes both prepared-statement caches per connection: asyncpg's
    and the SQLAlchemy dialect's. 0 is for PgBouncer in transaction pooling mode, where
    consecutive transactions of one connection may run on different server connections, so no
    prepared statement may outlive its transaction: both caches are off and every statement is
    prepared unnamed. asyncpg >= 0.31 does that by itself once its cache is off; older versions
    name them ``__asyncpg_stmt_<n>__``, counting per connection, so two clients collide on one
    server connection. SQLAlchemy's documented recipe, unique names from
    ``prepared_statement_name_func``, avoids the collision but leaves every statement behind
    on the server connection until PgBouncer closes it. tests/test_pgbouncer.py checks that
    nothing is left behind, and that the default cache does break under transaction pooling."""
    connect_args: dict[str, Any] = {
        "statement_cache_size": statement_cache_size,
        "prepared_statement_cache_size": statement_cache_size,
        "command_timeout": 30,
        "server_settings": {"application_name": "turnstore"},
    }
    if statement_cache_size == 0:
        connect_args["prepared_statement_name_func"] = _unnamed
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        # DB_POOL_SIZE is the hard limit per process: a turn holds a connection only to load and
        # to commit, never while the provider works, so a small pool serves many turns.
        max_overflow=0,
        pool_timeout=10,
        # A stale connection (database restarted, backend terminated) is replaced at checkout
        # instead of failing a request. Behind PgBouncer the ping is BEGIN; ";"; ROLLBACK (the
        # dialect wraps it in a transaction), so it runs on one server connection and holds it
        # no longer than that.
        pool_pre_ping=True,
        # json columns hold replay items that turnstore never decodes: read them as text.
        json_deserializer=lambda text: text,
        hide_parameters=True,  # SQL errors must not carry message text into logs
        # Autocommit by default: a one-statement read needs no BEGIN/COMMIT, and the pre-ping
        # is one round trip instead of three. Writes open a real transaction (store/tx.py).
        isolation_level="AUTOCOMMIT",
        connect_args=connect_args,
    )


def resolve_database(settings: Settings, *, migrate: bool = True) -> tuple[str, Callable[[], None]]:
    """DATABASE_URL, or the embedded server under the data dir (started on first use, and
    migrated when ``migrate``: only the embedded database is migrated automatically).
    Returns the URL and what to call at shutdown (stops the server if this call started it)."""
    if settings.database_url:
        return settings.database_url, lambda: None
    from service.embedded import ensure_embedded_postgres
    from service.migrate import upgrade

    server = ensure_embedded_postgres(settings.data_dir)
    if migrate:
        upgrade(server.url)
    return server.url, server.stop
