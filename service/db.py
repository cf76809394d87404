"""The async engine: one pool per process, recovering by itself after database restarts."""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def async_url(url: str) -> str:
    """Accept postgres:// and postgresql:// URLs; always drive them with asyncpg."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed.render_as_string(hide_password=False)


def create_engine(url: str, *, pool_size: int = 10, statement_cache_size: int = 100) -> AsyncEngine:
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=10,
        # A stale connection (database restarted, backend terminated) is replaced at checkout
        # instead of failing a request.
        pool_pre_ping=True,
        # json columns hold replay items that turnstore never decodes: read them as text.
        json_deserializer=lambda text: text,
        # statement_cache_size=0 is what PgBouncer in transaction mode needs.
        connect_args={
            "statement_cache_size": statement_cache_size,
            "command_timeout": 30,
            "server_settings": {"application_name": "turnstore"},
        },
    )
