"""Idempotency keys in PostgreSQL, so a retry on any replica finds the first attempt.

A key is claimed as 'running' with a lease; the turn's commit statement marks it 'done'
(``_Statements.commit`` in store/postgres.py), naming the commit (conversation and revision),
and a failed attempt releases it. A claim whose lease or TTL ran out is taken over, so a
crashed replica never blocks a key for good. A done key goes with its conversation (foreign
key, ON DELETE CASCADE) and with its TTL (``turnstore purge``). These are the statements;
``PostgresStore`` runs them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from service.core.errors import IdempotencyKeyReused, RequestInProgress
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.postgres.tables import idempotency_keys as k


def _in(seconds: str) -> Any:
    """now() plus the bound number of seconds."""
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam(seconds))


_THIS_KEY = (k.c.owner == sa.bindparam("caller"), k.c.key == sa.bindparam("idem_key"))

CLAIM = (
    insert(k)
    .values(
        owner=sa.bindparam("caller"),
        key=sa.bindparam("idem_key"),
        request_hash=sa.bindparam("request_hash"),
        state="running",
        turn_id=sa.bindparam("claimed_turn"),
        created_at=sa.func.now(),
        expires_at=_in("lease_s"),
    )
    .on_conflict_do_update(
        index_elements=[k.c.owner, k.c.key],
        set_={
            "request_hash": sa.bindparam("request_hash"),
            "state": "running",
            "turn_id": sa.bindparam("claimed_turn"),
            "conversation_id": None,
            "revision": None,
            "created_at": sa.func.now(),
            "expires_at": _in("lease_s"),
        },
        where=k.c.expires_at < sa.func.now(),  # only an expired key is taken over
    )
    .returning(k.c.state)
)

EXISTING = sa.select(
    k.c.request_hash, k.c.state, k.c.conversation_id, k.c.revision, k.c.turn_id
).where(*_THIS_KEY)

LIVE = EXISTING.where(k.c.expires_at >= sa.func.now())

RELEASE = sa.delete(k).where(*_THIS_KEY, k.c.state == "running")

EXPIRED = sa.delete(k).where(k.c.expires_at < sa.func.now())

DELETE_OWNED = sa.delete(k).where(k.c.owner == sa.bindparam("owner"))


def key_params(key: IdempotencyKey, data_key: DataKey | None = None) -> dict[str, Any]:
    """The statements' parameters; with encryption the request hash is kept keyed by the
    owner's data key (a plain hash of a short message would confirm a guess of it)."""
    stored = data_key.digest(key.request_hash) if data_key else key.request_hash
    return {"caller": key.owner, "idem_key": key.key, "request_hash": stored}


def answer(row: Any, key: IdempotencyKey, data_key: DataKey | None = None) -> Committed:
    """What an existing record means for ``key``: its commit, or the error to raise. A hash
    stored in either form matches (a key claimed before encryption was switched on)."""
    hashes = {key.request_hash, data_key.digest(key.request_hash) if data_key else None}
    if row.request_hash not in hashes:
        raise IdempotencyKeyReused()
    if row.state != "done":
        raise RequestInProgress(turn_id=row.turn_id)
    return Committed(row.conversation_id, row.revision, row.turn_id)
