"""Idempotency keys in PostgreSQL, so a retry on any replica finds the first attempt.

A key is claimed as 'running' with a lease; the turn's commit statement marks it 'done'
(statements.COMMIT), naming the commit (conversation and revision), and a failed attempt
releases it. A claim whose lease or TTL ran out is taken over, so a crashed replica never
blocks a key for good. A done key goes with its conversation (foreign key, ON DELETE CASCADE)
and with its TTL (``turnstore purge``). These are the statements and what a record means;
``PostgresStore`` runs them.
"""

from __future__ import annotations

from typing import Any

from service.core.errors import IdempotencyKeyReused, RequestInProgress
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.postgres.tx import sql

# A claim, or the takeover of an expired one (only an expired key is taken over). :now and
# :until (when the claim's lease runs out) come from the caller's clock: Citus refuses now()
# (not immutable) in an ON CONFLICT DO UPDATE.
CLAIM = sql("""
    INSERT INTO idempotency_keys
        (owner, key, request_hash, state, turn_id, created_at, expires_at)
    VALUES (:caller, :idem_key, :request_hash, 'running', :claimed_turn, :now, :until)
    ON CONFLICT (owner, key) DO UPDATE SET
        request_hash = :request_hash,
        state = 'running',
        conversation_id = NULL,
        revision = NULL,
        turn_id = :claimed_turn,
        created_at = :now,
        expires_at = :until
    WHERE idempotency_keys.expires_at < :now
    RETURNING idempotency_keys.state
""")
RECORD = """
    SELECT request_hash, state, conversation_id, revision, turn_id FROM idempotency_keys
    WHERE owner = :caller AND key = :idem_key
"""
EXISTING = sql(RECORD)
LIVE = sql(RECORD + " AND expires_at >= now()")
RELEASE = sql("""
    DELETE FROM idempotency_keys WHERE owner = :caller AND key = :idem_key AND state = 'running'
""")
RELEASE_RUN = sql("""
    DELETE FROM idempotency_keys WHERE owner = :owner AND turn_id = :turn_id AND state = 'running'
""")
# The keys that committed to a deleted conversation (on plain PostgreSQL its foreign key does
# this first; on Citus, where keys are placed by owner, there is none: deleting does it).
DELETE_OF = sql("DELETE FROM idempotency_keys WHERE owner = :caller AND conversation_id = :cid")
EXPIRED = sql("DELETE FROM idempotency_keys WHERE expires_at < now()")
DELETE_OWNED = sql("DELETE FROM idempotency_keys WHERE owner = :owner")


def key_params(key: IdempotencyKey, data_key: DataKey | None = None) -> dict[str, Any]:
    """The statements' parameters; with encryption the request hash is kept keyed by the
    owner's data key (a plain hash of a short message would confirm a guess of it)."""
    stored = data_key.digest(key.request_hash) if data_key else key.request_hash
    return {"caller": key.owner, "idem_key": key.key, "request_hash": stored}


def answer(row: Any, key: IdempotencyKey, data_key: DataKey | None = None) -> Committed:
    """What an existing record means for ``key``: its commit, or the error to raise. A hash
    stored in either form matches (a key claimed before encryption was switched on)."""
    hashes = {key.request_hash, data_key.digest(key.request_hash) if data_key else None}
    if row["request_hash"] not in hashes:
        raise IdempotencyKeyReused()
    if row["state"] != "done":
        raise RequestInProgress(turn_id=row["turn_id"])
    return Committed(row["conversation_id"], row["revision"], row["turn_id"])
