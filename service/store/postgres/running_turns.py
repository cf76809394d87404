"""OWNER_MAX_RUNNING_TURNS in PostgreSQL: each running turn holds a place among its owner's
running turns (a row of ``owner_turns``, migration 0018), for every replica to count.

There are as many places as the limit, numbered; a turn takes a free one before the provider
is called (``turnstore_take_turn()``: the primary key (owner, place) lets no two turns hold
one, so no more than the limit can run, and turns of one owner never queue for each other)
and gives it back when it ends; a replica that dies leaves places that stop counting at their
``until`` (renewed while their turns run). On plain PostgreSQL the place is taken and given
back inside statements the turn makes anyway (its lease, its run's creation, its commit:
``folded``); on Citus the places live on the coordinator (placement.py: a worker down stops
no other worker's conversations) and those statements run on the conversation's worker, so
there the places have statements of their own, which need no worker (the store asks the
server once which it is).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.store.postgres.statements import FREE_TURN, NO_SYNC_WAIT, TAKE_TURN_CALL
from service.store.postgres.tx import Params, driver, grouped, sql, written

TAKE = sql(f"SELECT taken FROM {TAKE_TURN_CALL}")
FREE = sql(FREE_TURN)
# By owner and holder (a turn's, so of one owner): on Citus made once per owner
# (Adapter.each_group), on the coordinator's own table.
RENEW = sql(f"""
    WITH r AS (
        UPDATE owner_turns SET until = CAST(:until AS timestamptz)
        WHERE owner = ANY(CAST(:owners AS text[])) AND holder = ANY(CAST(:holders AS uuid[]))
        RETURNING holder
    )
    SELECT r.holder, {NO_SYNC_WAIT} FROM r
""")
CITUS = sql("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")


def clock(lease_s: float) -> Params:
    """Now, and when something taken now runs out, by this replica's clock (Citus refuses
    now() where the statements need it)."""
    now = datetime.now(UTC)
    return {"now": now, "until": now + timedelta(seconds=lease_s)}


class RunningTurns:
    """The running turns' places over one engine; ``most`` per owner (None: no limit, and on
    Citus no statement). One per adapter value (adapter.py): the lease, the commit, a run's
    creation and the Places port take and give back the same places."""

    def __init__(self, engine: AsyncEngine, most: int | None) -> None:
        self._engine = engine
        self.most = most
        self._citus: bool | None = None

    async def folded(self, conn: asyncpg.Connection | None = None) -> bool:
        """Whether the places are taken and given back inside the turn's own statements
        (plain PostgreSQL), not by statements of their own (Citus). Asked once, on ``conn``
        if the caller holds one (in a transaction: no second connection taken meanwhile)."""
        if self._citus is None and conn is not None:
            self._citus = bool(await CITUS.fetchval(conn, {}))
        elif self._citus is None:
            async with driver(self._engine, write=False) as conn:
                self._citus = bool(await CITUS.fetchval(conn, {}))
        return not self._citus

    async def apart(self) -> bool:
        """Whether this turn's place needs a statement of its own (Citus, with a limit)."""
        return self.most is not None and not await self.folded()

    def params(self, owner: str, holder: UUID, lease_s: float) -> Params:
        """What a statement that takes a place (TAKE_TURN_CALL) is given."""
        return {"caller": owner, "holder": holder, "most": self.most, **clock(lease_s)}

    async def take(self, owner: str, holder: UUID, lease_s: float) -> bool:
        params = self.params(owner, holder, lease_s)

        async def take() -> bool:
            async with driver(self._engine, write=False) as conn:
                return bool(await TAKE.fetchval(conn, params))

        return await written(take)

    async def free(self, owner: str, holder: UUID) -> None:
        async def free() -> None:
            async with driver(self._engine, write=False) as conn:
                await FREE.execute(conn, {"caller": owner, "holder": holder})

        await written(free)

    def renewals(self, turns: Sequence[tuple[str, UUID]], lease_s: float) -> list[Params]:
        """RENEW's batches, one per owner."""
        until = clock(lease_s)["until"]
        return [
            {"owners": [owner], "holders": holders, "until": until}
            for owner, holders in grouped(turns).items()
        ]
