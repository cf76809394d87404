"""The one way the PostgreSQL adapters reach the database: statements compiled once for
asyncpg (``sql``), run on the asyncpg connection under a pooled SQLAlchemy one (``driver``),
with one failure mapping."""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast

import asyncpg
import sqlalchemy as sa
from asyncpg.transaction import Transaction
from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import QueuePool
from sqlalchemy.util import greenlet_spawn

from migrations.commit_function import CLAIM_LOST_STATE, RUN_ENDED_STATE, SHREDDED_STATE
from service.core.errors import (
    NotMigrated,
    OwnerShredded,
    RequestInProgress,
    StorageError,
    TurnInterrupted,
    TurnstoreError,
)
from service.platform.db import POOL_TIMEOUT_S, readable

# What a database failure looks like, from SQLAlchemy or from the driver underneath it, by
# class: every error of either (and of the network under them) that says the database failed,
# whatever the reason (tests/system/test_db_failures.py provokes each kind on a real server).
FAILURES: tuple[type[BaseException], ...] = (
    # SQLAlchemy's wrapper of a driver error (a statement run through an Engine's Connection).
    sa.exc.DBAPIError,
    # The asyncpg dialect's PEP 249 errors (the base of them all): what the pool raises when
    # a new connection fails at the server (a refused login 28000, a database starting up or
    # shutting down 57P03, too many clients 53300, a backend terminated while the connection
    # was set up 57P01). The pool does not wrap them in a DBAPIError; only an Engine would.
    asyncpg_dialect.AsyncAdapt_asyncpg_dbapi.Error,
    sa.exc.DisconnectionError,
    sa.exc.TimeoutError,  # the pool's own wait for a connection ran out
    asyncpg.PostgresError,  # whatever the server says (SQLSTATE), on a connection or at connect
    asyncpg.InterfaceError,  # a connection closed or lost, as asyncpg saw it
    # A backend's FATAL that arrives while the connection is idle (the postmaster died first)
    # leaves asyncpg's protocol in a state whose next use raises this.
    asyncpg.InternalClientError,
    OSError,  # refused, reset, unreachable: the network's, raised as it is
    TimeoutError,  # asyncpg's connect timeout
)
# What the pool's checkout may raise besides: a connection it had discarded as closed by the
# server (``_skip_closed``, platform/db.py) replaced by a new one that the server closed as
# well, and then ``InvalidRequestError("This connection is closed")`` (the pool's reconnection
# attempts at checkout ran out). Only there is that class a database failure.
_CHECKOUT_FAILURES: tuple[type[BaseException], ...] = (*FAILURES, sa.exc.InvalidRequestError)


READ_ONLY = "25006"  # read_only_sql_transaction: the statement did nothing
NOT_MIGRATED = frozenset({"42P01", "42883"})  # undefined_table, undefined_function
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")
Params = dict[str, Any]


def grouped(pairs: Iterable[tuple[K, V]]) -> dict[K, list[V]]:
    """The second of each pair, by the first (rows by their shard group's key)."""
    groups: dict[K, list[V]] = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return groups


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of asyncpg's own error, or of SQLAlchemy's wrapper of it."""
    state = getattr(exc, "sqlstate", None) or getattr(getattr(exc, "orig", None), "sqlstate", None)
    return state if isinstance(state, str) else None


class _Lent:
    """The engine's pooled connections as this event loop's statements use them.

    A statement takes a connection that an earlier statement gave back here, without asking
    SQLAlchemy's pool: a checkout and a check-in through the pool are a greenlet hop each
    (the pool's code runs synchronously, and may have to connect), and a plain turn makes two
    of each per statement: 0.2 ms of its server CPU (bench/README.md, section 8). Only when
    none is idle here does a statement check one out of the pool. So connections stay
    checked out of the pool while idle here; they are the pool's as before: no more of them
    than its size (turns wait for one in asyncio, ``limit``), the pool's checkout check for
    each one it hands out, and here the same check (``_closed``) before one is lent again.
    ``engine.dispose()`` closes the idle ones too (the engine's ``engine_disposed`` event),
    so a read-only refusal, a failover or shutdown leaves none behind; one in use then goes
    back to the old pool, as it did. One per engine and event loop (asyncpg's connections
    belong to the loop that made them)."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # Not the engine itself: ``_lents`` holds this as long as the engine lives.
        self._engine = weakref.ref(engine.sync_engine)
        self.idle: list[Any] = []  # _ConnectionFairy, checked out of the engine's pool
        self.limit = _limit(engine.sync_engine.pool)

    @property
    def _pool(self) -> sa.Pool:
        """The engine's pool now (``dispose()`` replaces it)."""
        engine = self._engine()
        assert engine is not None  # a statement of it is running
        return engine.pool

    @classmethod
    def of(cls, engine: AsyncEngine) -> _Lent:
        sync, loop = engine.sync_engine, asyncio.get_running_loop()
        lent = _lents.get(sync)
        if lent is not None and lent.loop is loop:
            return lent
        if lent is None:
            sa.event.listen(sync, "engine_disposed", _close_idle)
        else:  # another event loop's (tests): its connections cannot be used from this one
            lent.drop()
        lent = _lents[sync] = cls(engine, loop)
        return lent

    async def take(self) -> Any:
        """A connection for one statement (group), or a failure of the pool's."""
        limit = self.limit
        if limit is not None and limit.locked():
            async with asyncio.timeout(POOL_TIMEOUT_S):
                await limit.acquire()
        elif limit is not None:
            await limit.acquire()  # free: taken without suspending
        try:
            while self.idle:
                fairy = self.idle.pop()
                if fairy._pool is not self._pool:  # disposed without closing
                    await greenlet_spawn(fairy.close)
                elif _closed(fairy.driver_connection):  # the server closed it meanwhile
                    await greenlet_spawn(fairy.invalidate)
                else:
                    return fairy
            return await greenlet_spawn(self._pool.connect)
        except BaseException:
            if limit is not None:
                limit.release()
            raise

    async def give_back(self, fairy: Any) -> None:
        """A connection whose statements ended (in a transaction: it ended inside its block),
        idle here again; one of a pool disposed meanwhile goes back to that pool."""
        try:
            if fairy._pool is self._pool and fairy.is_valid:
                self.idle.append(fairy)
            else:
                await greenlet_spawn(fairy.close)
        finally:
            if self.limit is not None:
                self.limit.release()

    async def discard(self, fairy: Any, exc: BaseException) -> None:
        try:
            await greenlet_spawn(fairy.invalidate, exc)  # which gives it back
        finally:
            if self.limit is not None:
                self.limit.release()

    def close_idle(self) -> None:
        """In ``engine.dispose()``'s greenlet: each idle connection closed (at once, if the
        engine is disposed from another event loop than the one they belong to)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:
            self.drop()
            return
        idle, self.idle = self.idle, []
        for fairy in idle:
            with contextlib.suppress(Exception):  # a close that fails closes the rest still
                fairy.invalidate()

    def drop(self) -> None:
        """Another event loop's: closed at once, without awaiting (it cannot be awaited)."""
        idle, self.idle = self.idle, []
        for fairy in idle:
            with contextlib.suppress(Exception):
                fairy.invalidate()  # terminated, not closed: nothing awaited


_lents: weakref.WeakKeyDictionary[sa.Engine, _Lent] = weakref.WeakKeyDictionary()


def _close_idle(engine: sa.Engine) -> None:
    lent = _lents.get(engine)
    if lent is not None:
        lent.close_idle()


def _closed(connection: Any) -> bool:
    """The checkout check of platform/db.py, for a connection idle here."""
    return bool(connection.is_closed() or readable(connection))


def in_use(engine: AsyncEngine) -> int:
    """The pool's connections running statements now (idle ones lent here not counted)."""
    lent = _lents.get(engine.sync_engine)
    idle = len(lent.idle) if lent is not None else 0
    return engine.sync_engine.pool.checkedout() - idle  # type: ignore[attr-defined,no-any-return]


def _limit(pool: sa.Pool) -> asyncio.Semaphore | None:
    """Turns wait for a connection here, in asyncio, rather than in the pool: a checkout then
    always finds a connection free, which SQLAlchemy's queue hands out without awaiting, where
    a wait in it is a greenlet switch, an ``asyncio.wait_for`` and a queue's futures (a plain
    turn at 32 turns in flight on a pool of 10 spent more on waiting there than on its two
    statements). None for a pool without a fixed size."""
    if not isinstance(pool, QueuePool) or pool.size() <= 0 or pool._max_overflow < 0:
        return None  # no limit to wait for
    return asyncio.Semaphore(pool.size() + pool._max_overflow)


async def written(write: Callable[[], Awaitable[T]]) -> T:
    """Run a write; if a read-only session refused it (it did nothing), run it once more on a
    fresh session, so the first write after the database is writable again succeeds. No
    other failure is retried: a lost COMMIT acknowledgement is not a failure to hide."""
    try:
        return await write()
    except StorageError as exc:
        if exc.sqlstate != READ_ONLY:
            raise
    return await write()


def driver(engine: AsyncEngine, *, write: bool) -> _Borrowed:
    """``async with driver(engine, write=...) as conn``: the asyncpg connection of a pooled
    one, lent to this event loop (``_Lent``), without SQLAlchemy's per-execution work. Without
    ``write`` each statement commits by itself (the engine autocommits, see platform/db.py: one
    statement is one round trip and sees one snapshot); ``write`` runs them in one READ
    COMMITTED transaction. Any database failure becomes StorageError, and the connection it
    happened on is discarded: after a failover or a restart the pool must not hand out a
    session that is read-only or half-dead. A read-only refusal discards every idle session:
    one opened while the database was read-only stays so after it is writable again."""
    return _Borrowed(engine, write)


class _Borrowed:
    """``driver``'s connection for the time inside (a class, not two nested generators: every
    statement takes one, a streamed turn nine)."""

    __slots__ = ("_engine", "_fairy", "_lent", "_tx", "_write")

    def __init__(self, engine: AsyncEngine, write: bool) -> None:
        self._engine, self._write = engine, write
        self._lent: _Lent | None = None
        self._fairy: Any = None
        self._tx: Transaction | None = None

    async def __aenter__(self) -> asyncpg.Connection:
        lent = self._lent = _Lent.of(self._engine)
        try:
            self._fairy = await lent.take()
        except _CHECKOUT_FAILURES as exc:
            raise await _failure(self._engine, exc) from exc
        connection: asyncpg.Connection = self._fairy.driver_connection
        if self._write:
            transaction = connection.transaction(isolation="read_committed")
            try:
                await transaction.start()
            except BaseException as exc:
                await self._given_back(exc)
                raise
            self._tx = transaction
        return connection

    async def __aexit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if self._tx is not None:
            try:
                if exc is None:
                    await self._tx.commit()
                else:
                    await self._tx.rollback()
            except BaseException as ended:  # the end failed (or was cancelled): that counts
                await self._given_back(ended)
                raise
        await self._given_back(exc)

    async def _given_back(self, exc: BaseException | None) -> None:
        """The connection given back (discarded after a database failure, which is raised as
        StorageError; any other exception is the caller's to raise)."""
        lent, fairy = self._lent, self._fairy
        assert lent is not None  # entered
        if exc is None:
            await lent.give_back(fairy)
        elif isinstance(exc, FAILURES):
            await lent.discard(fairy, exc)
            raise await _failure(self._engine, exc) from exc
        else:
            await asyncio.shield(lent.give_back(fairy))  # cancelled: given back anyway


async def _failure(engine: AsyncEngine, exc: BaseException) -> TurnstoreError:
    """What a database failure is to the caller; after a read-only refusal the engine's idle
    sessions are closed. A write refused because its owner was shredded, because its
    attempt lost its Idempotency-Key's claim, or because the run its commit ends had ended (a
    statement raised SHREDDED_STATE, CLAIM_LOST_STATE or RUN_ENDED_STATE,
    migrations/commit_function.py), is no failure: it wrote nothing."""
    state = sqlstate(exc)
    if state == SHREDDED_STATE:
        return OwnerShredded()
    if state == CLAIM_LOST_STATE:  # another attempt with its Idempotency-Key runs it now
        return RequestInProgress()
    if state == RUN_ENDED_STATE:  # the turn's run was interrupted meanwhile: nothing committed
        return TurnInterrupted()
    if state == READ_ONLY:
        await engine.dispose()
    if state in NOT_MIGRATED:  # this release's table or function is not there (yet)
        return NotMigrated(sqlstate=state, worker=worker_of(exc))
    return StorageError(sqlstate=state, worker=worker_of(exc))


# Where Citus names the worker behind an error ("host:port"; its src/backend/distributed/
# connection/remote_commands.c and executor/adaptive_executor.c): a connection to it that
# failed, in the message; an error it raised, in the context Citus adds.
_WORKER = re.compile(
    r"connection to the remote node (?:[^@\s]+@)?(\S+:\d+)"
    r"|could not establish any connections to the node (\S+:\d+)"
    r"|while executing command on (\S+:\d+)"
)


def worker_of(exc: BaseException | None) -> str | None:
    """The Citus worker ("host:port") a database failure names, if it names one: the server's
    error itself, or the one SQLAlchemy's wrapper holds. Only the address is taken from the
    text (which may quote a statement's values)."""
    # SQLAlchemy's DBAPIError holds the dialect's error (orig), raised from asyncpg's.
    for error in (
        exc,
        getattr(exc, "orig", None),
        getattr(getattr(exc, "orig", None), "__cause__", None),
    ):
        if isinstance(error, asyncpg.PostgresError):
            for text in (error.message, getattr(error, "context", None)):
                found = _WORKER.search(text or "")
                if found:
                    return next(group for group in found.groups() if group)
    return None


class Compiled:
    """A statement compiled once for asyncpg: its SQL, and its parameters in order."""

    def __init__(self, statement: sa.TextClause, dialect: sa.Dialect) -> None:
        # positiontup: the parameters' names in the order of $1, $2, ...
        compiled: Any = cast(Any, statement.compile(dialect=dialect))
        self.sql = str(compiled)
        self._names = tuple(compiled.positiontup or ())

    def args(self, params: Params) -> list[Any]:
        """The values for $1, $2, ... from ``params`` (which may hold more). A text
        statement's parameters have no type that would convert them: they go as they are."""
        return [params[name] for name in self._names]

    async def fetch(self, conn: asyncpg.Connection, params: Params) -> list[asyncpg.Record]:
        rows: list[asyncpg.Record] = await conn.fetch(self.sql, *self.args(params))
        return rows

    async def fetchrow(self, conn: asyncpg.Connection, params: Params) -> asyncpg.Record | None:
        return await conn.fetchrow(self.sql, *self.args(params))

    async def fetchval(self, conn: asyncpg.Connection, params: Params) -> Any:
        return await conn.fetchval(self.sql, *self.args(params))

    async def execute(self, conn: asyncpg.Connection, params: Params) -> None:
        await conn.execute(self.sql, *self.args(params))

    async def executemany(self, conn: asyncpg.Connection, rows: Iterable[Params]) -> None:
        await conn.executemany(self.sql, [self.args(row) for row in rows])


_DIALECT: sa.Dialect = asyncpg_dialect.dialect()  # type: ignore[no-untyped-call]


def sql(text: str) -> Compiled:
    """A statement written as SQL with ``:name`` parameters, compiled once for asyncpg (its
    whitespace folded: the source is laid out for people, the wire gets one line; so no
    ``--`` comments in it: say why in Python)."""
    if "--" in text:
        raise ValueError("a -- comment would swallow the rest of the folded statement")
    folded = " ".join(text.split()).replace("( ", "(").replace(" )", ")").replace(" ,", ",")
    return Compiled(sa.text(folded), _DIALECT)
