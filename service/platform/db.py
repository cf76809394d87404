"""Connecting: the async engine (one pool per process, recovering by itself after database
restarts), the URL as asyncpg takes it, and the arguments of a connection outside the pool.
Which database to connect to, and whether it is migrated first, is platform/startup.py's."""

from __future__ import annotations

import select
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


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


POOL_TIMEOUT_S = 10  # how long a statement waits for a connection of the pool
APPLICATION_NAME = "turnstore"  # the pool's sessions, as pg_stat_activity names them


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
    on the server connection until PgBouncer closes it. tests/system/test_pgbouncer.py checks that
    nothing is left behind, and that the default cache does break under transaction pooling."""
    connect_args: dict[str, Any] = {
        "statement_cache_size": statement_cache_size,
        "prepared_statement_cache_size": statement_cache_size,
        "command_timeout": 30,
        "server_settings": {"application_name": APPLICATION_NAME},
    }
    if statement_cache_size == 0:
        connect_args["prepared_statement_name_func"] = _unnamed
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        # DB_POOL_SIZE is the hard limit per process: a turn holds a connection only to load and
        # to commit, never while the provider works, so a small pool serves many turns.
        max_overflow=0,
        pool_timeout=POOL_TIMEOUT_S,
        # No ping per checkout (a round trip per statement group): a connection the server
        # closed (restart, failover, terminated backend, a pooler restart) is known closed to
        # asyncpg without a round trip, and ``_skip_closed`` replaces it at checkout. One the
        # network lost silently fails its statement and is discarded (store/postgres/tx.py).
        pool_pre_ping=False,
        # No rollback when a connection goes back: statements run on the asyncpg connection
        # itself (store/postgres/tx.py), where a transaction always ends inside its block, so
        # SQLAlchemy's rollback had nothing to do, each time.
        pool_reset_on_return=None,
        # json columns hold replay items that turnstore never decodes: read them as text.
        json_deserializer=lambda text: text,
        hide_parameters=True,  # SQL errors must not carry message text into logs
        # Autocommit by default: a one-statement read or write (a plain turn's lease and its
        # commit) needs no BEGIN/COMMIT round trips. Others open a transaction
        # (store/postgres/tx.py).
        isolation_level="AUTOCOMMIT",
        connect_args=connect_args,
    )
    event.listen(engine.sync_engine, "checkout", _skip_closed)
    return engine


def _skip_closed(connection: Any, record: Any, proxy: Any) -> None:
    """A pooled connection the server has closed meanwhile is not handed out: the pool
    discards it and checks out another (or connects anew). No round trip: asyncpg knows once
    its event loop has seen the close, and before that the socket is readable (an idle
    connection of the pool has nothing to read but the server's goodbye)."""
    driver = connection.driver_connection
    if driver.is_closed() or readable(driver):
        raise DisconnectionError("the server closed this connection")


def readable(driver: Any) -> bool:
    """Whether an idle connection's socket has something to read: the server's goodbye."""
    transport = getattr(driver, "_transport", None)  # asyncpg's, not public
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    return bool(poll.poll(0))
