"""The one value every PostgreSQL class of a port holds (each is composed over it, none
inherits it): the engine, the statements compiled for its retention, the keyring, the limits
it was made with and the running turns' places; and the three things several ports do with
it: complete a write's Idempotency-Key in its transaction, read a conversation's info back,
wake waiters on other replicas."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import StorageError
from service.core.model import ConversationInfo, IdempotencyKey
from service.store.postgres import idempotency as idem
from service.store.postgres import receipts
from service.store.postgres.keyring import Keyring
from service.store.postgres.rows import reading
from service.store.postgres.running_turns import RunningTurns
from service.store.postgres.statements import Statements
from service.store.postgres.tx import Compiled, Params, driver


@dataclass(frozen=True)
class StoreConfig:
    """The limits of a PostgreSQL store (each a setting's: service/app.py postgres_adapter)."""

    retention_days: float | None = None  # RETENTION_DAYS (None: idle conversations stay)
    idempotency_ttl_s: float = 86_400  # IDEMPOTENCY_TTL_S
    idempotency_lease_s: float = 600  # a claimed key whose replica died is taken over then
    events_ttl_s: float = 600  # TURN_EVENTS_TTL_S
    stored_response_ttl_s: float = 30 * 86_400  # STORED_RESPONSE_TTL_DAYS
    forks_per_minute: int | None = None  # OWNER_MAX_FORKS_PER_MINUTE (None: any)
    running_turns: int | None = None  # OWNER_MAX_RUNNING_TURNS (None: any)


class Adapter:
    """One PostgreSQL database as the ports' classes reach it."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: StoreConfig | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or StoreConfig()
        # With a keyring (ENCRYPTION_KEYS_FILE), what users said is written sealed.
        self.keyring = keyring
        self.sql = Statements(self.config.retention_days)
        self.places = RunningTurns(engine, self.config.running_turns)

    async def distributed(self, conn: asyncpg.Connection | None = None) -> bool:
        """Whether this is a Citus coordinator (the store asks the server once: on ``conn`` if
        the caller holds one)."""
        return not await self.places.folded(conn)

    async def each_group(
        self, statement: Compiled, batches: Sequence[Params]
    ) -> list[asyncpg.Record]:
        """``statement`` (autocommitted) over rows of several shard groups, each batch naming
        one group's rows in its list parameters (one conversation's, or one owner's). On Citus
        one statement per batch, side by side, each routed to the worker of its group: one
        statement over several groups would touch every shard, and a write would be a
        two-phase commit on every worker it reaches. On plain PostgreSQL one statement over
        all of them (a list parameter that is None in a batch, not known there, is None)."""
        if not batches:
            return []
        if not await self.distributed():
            batches = [merged(batches)]

        async def one(params: Params) -> list[asyncpg.Record]:
            async with driver(self.engine, write=False) as conn:
                return await statement.fetch(conn, params)

        done = await asyncio.gather(*(one(params) for params in batches), return_exceptions=True)
        for result in done:  # every statement finished first: none cut short mid-query
            if isinstance(result, BaseException):
                raise result
        return [row for rows in done if not isinstance(rows, BaseException) for row in rows]

    async def completed(
        self, conn: asyncpg.Connection, key: IdempotencyKey | None, cid: Any, revision: int | None
    ) -> None:
        """In a write's transaction: its Idempotency-Key, if it came with one, names what it
        did (the conversation it made or changed, the revision it left; a deletion: none)."""
        await idem.complete(conn, key, cid, revision, self.config.idempotency_ttl_s)
        if key is not None:  # on Citus its receipt, on its conversation's worker
            await receipts.write(self, conn, key, revision, self.config.idempotency_ttl_s)

    async def info_of(self, row: asyncpg.Record, owner: str) -> ConversationInfo:
        """A conversation read back (statements.INFO), its metadata opened if sealed."""
        codec = await reading(self.keyring, owner, row["id"], [row], ["metadata"])
        return codec.info(row)

    async def wake(self, topics: list[str]) -> None:
        """Wake those waiting on ``topics`` elsewhere (a released lease, a run's events)."""
        # In a transaction of its own: a NOTIFY takes a global lock until its transaction has
        # committed, replication wait included, so inside the commit it would line all commits
        # up behind each other.
        with contextlib.suppress(StorageError):  # those woken look again by themselves
            async with driver(self.engine, write=False) as conn:
                await self.sql.wake.execute(conn, {"topics": topics})


def merged(batches: Sequence[Params]) -> Params:
    """Batches of Adapter.each_group as one: list parameters joined (None if one is None)."""
    merged = dict(batches[0])
    for name in batches[0]:
        values = [batch[name] for batch in batches]
        if any(isinstance(value, list) for value in values):
            merged[name] = None if None in values else [v for each in values for v in each]
    return merged
