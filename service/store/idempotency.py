"""Idempotency keys in PostgreSQL, so a retry on any replica finds the first attempt.

A key is claimed as 'running' with a lease; the turn's commit marks it 'done' with the
response in the same transaction (``complete``); a failed turn releases it. A claim whose
lease or TTL ran out is taken over, so a crashed replica never blocks a key for good.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.errors import IdempotencyKeyReused, RequestInProgress
from service.model import IdempotencyKey
from service.store.tables import idempotency_keys as k
from service.store.tx import read, transaction

_CLAIM = (
    insert(k)
    .values(
        owner=sa.bindparam("b_owner"),
        key=sa.bindparam("b_key"),
        request_hash=sa.bindparam("b_hash"),
        state="running",
        created_at=sa.func.now(),
        expires_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam("lease")),
    )
    .on_conflict_do_update(
        index_elements=[k.c.owner, k.c.key],
        set_={
            "request_hash": sa.bindparam("b_hash"),
            "state": "running",
            "response": None,
            "created_at": sa.func.now(),
            "expires_at": sa.func.now()
            + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam("lease")),
        },
        where=k.c.expires_at < sa.func.now(),  # only an expired key is taken over
    )
    .returning(k.c.state)
)

_EXISTING = sa.select(k.c.request_hash, k.c.state, k.c.response).where(
    k.c.owner == sa.bindparam("b_owner"), k.c.key == sa.bindparam("b_key")
)

_LIVE = _EXISTING.where(k.c.expires_at >= sa.func.now())

_RELEASE = sa.delete(k).where(
    k.c.owner == sa.bindparam("b_owner"), k.c.key == sa.bindparam("b_key"), k.c.state == "running"
)

COMPLETE = (
    sa.update(k)
    .where(k.c.owner == sa.bindparam("b_owner"), k.c.key == sa.bindparam("b_key"))
    .values(
        state="done",
        response=sa.bindparam("b_response"),
        expires_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam("ttl")),
    )
)


class IdempotencyStore:
    def __init__(self, engine: AsyncEngine, *, ttl_s: float, lease_s: float) -> None:
        self._engine = engine
        self.ttl_s = ttl_s
        self._lease_s = lease_s

    async def claim(self, key: IdempotencyKey) -> str | None:
        """Claim ``key`` for a new attempt (None), or return the committed response of the
        first attempt. Raises RequestInProgress while it runs, IdempotencyKeyReused when the
        key came with another request."""
        params = {"b_owner": key.owner, "b_key": key.key, "b_hash": key.request_hash}
        async with transaction(self._engine) as conn:
            claimed = await conn.scalar(_CLAIM, {**params, "lease": self._lease_s})
            if claimed is not None:
                return None
            row = (await conn.execute(_EXISTING, params)).one()
        return _answer(row, key)

    async def check(self, key: IdempotencyKey) -> None:
        """Raise now what ``claim`` would raise, without claiming: a stream reports these as
        JSON errors before it starts (``claim`` inside the turn still decides races)."""
        params = {"b_owner": key.owner, "b_key": key.key}
        async with read(self._engine) as conn:
            row = (await conn.execute(_LIVE, params)).first()
        if row is not None:
            _answer(row, key)

    async def release(self, key: IdempotencyKey) -> None:
        """A failed attempt does not use the key up."""
        async with transaction(self._engine) as conn:
            await conn.execute(_RELEASE, {"b_owner": key.owner, "b_key": key.key})


def _answer(row: Any, key: IdempotencyKey) -> str:
    if row.request_hash != key.request_hash:
        raise IdempotencyKeyReused()
    if row.state != "done":
        raise RequestInProgress()
    return str(row.response)


def completion(key: IdempotencyKey, response: str, ttl_s: float) -> dict[str, object]:
    """The parameters of ``COMPLETE``, run inside the turn's commit: the key now answers with
    this response until its TTL."""
    return {"b_owner": key.owner, "b_key": key.key, "b_response": response, "ttl": ttl_s}
