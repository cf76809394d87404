"""Idempotency keys in PostgreSQL, so a retry on any replica finds the first attempt.

A key is claimed as 'running' with a lease (TURN_LEASE_S, renewed while its write runs:
service/usecases/write_gate.py), by one attempt (its ``claim_id``); the turn's commit statement
marks it 'done' (statements.COMMIT), naming the commit (conversation and revision), as every
other write does in its own transaction (``complete``), and a failed attempt releases it: each
only while the attempt still holds its claim. A claim whose lease or TTL ran out is taken
over, so a crashed replica blocks a key for a lease at most (on Citus, where a key's outcome
can be in doubt, a released claim lapses instead and one that ran out is settled by its
write's receipt first: receipts.py). A done key goes
with its conversation (foreign key, ON DELETE CASCADE)
and with its TTL (``turnstore purge``). These are the statements and what a record means;
claims.py (PostgresIdempotency) runs them.
"""

from __future__ import annotations

from typing import Any

from migrations.commit_function import shredded
from service.core.errors import IdempotencyKeyReused, RequestInProgress
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.postgres.tx import sql

SHREDDED = shredded(":caller")


# A claim, or the takeover of an expired one (only an expired key is taken over). :now and
# :until (when the claim's lease runs out) come from the caller's clock: Citus refuses now()
# (not immutable) in an ON CONFLICT DO UPDATE.
# Each attempt's claim is its own (:claim, migration 0019): only the attempt that holds it
# completes, renews or releases the key. A shredded owner claims nothing. (Its values typed and
# named once, as ``excluded``: Citus plans an INSERT ... SELECT without the target's types.)
def claim_text(writing: bool = False) -> str:
    """CLAIM's text; ``writing``: on Citus, also recording the conversation the attempt writes,
    and taking over a running claim that recorded one never by its lease alone (its outcome
    may be in doubt: receipts.py settles it)."""
    column, value, update, lapsed = "", "", "", ""
    if writing:
        column, value = ", writing", ", CAST(:writing AS uuid)"
        update = ",\n        writing = excluded.writing"
        lapsed = (
            "\n        AND (idempotency_keys.state = 'done' OR idempotency_keys.writing IS NULL)"
        )
    return f"""
    INSERT INTO idempotency_keys
        (owner, key, request_hash, state, turn_id, created_at, expires_at, claim_id{column})
    SELECT CAST(:caller AS text), CAST(:idem_key AS text), CAST(:request_hash AS text),
        'running', CAST(:claimed_turn AS uuid), CAST(:now AS timestamptz),
        CAST(:until AS timestamptz), CAST(:claim AS uuid){value}
    WHERE NOT {SHREDDED}
    ON CONFLICT (owner, key) DO UPDATE SET
        request_hash = excluded.request_hash,
        state = 'running',
        conversation_id = NULL,
        revision = NULL,
        turn_id = excluded.turn_id,
        created_at = excluded.created_at,
        expires_at = excluded.expires_at,
        claim_id = excluded.claim_id{update}
    WHERE idempotency_keys.expires_at < excluded.created_at{lapsed}
    RETURNING idempotency_keys.state
"""


CLAIM = sql(claim_text())
RECORD_FIELDS = "request_hash, state, conversation_id, revision, turn_id"
OF_KEY = "FROM idempotency_keys WHERE owner = :caller AND key = :idem_key"
RECORD = f"SELECT {RECORD_FIELDS} {OF_KEY}"
EXISTING = sql(RECORD)
LIVE = sql(RECORD + " AND expires_at >= now()")
RELEASE = sql("""
    DELETE FROM idempotency_keys
    WHERE owner = :caller AND key = :idem_key AND state = 'running' AND claim_id = :claim
""")
# A write other than a turn's commit completes its key in its own transaction, naming the
# conversation it made or changed and the revision it left (a deletion: none).
COMPLETE = sql("""
    UPDATE idempotency_keys SET
        state = 'done', conversation_id = :done_cid, revision = :done_revision,
        expires_at = now() + make_interval(secs => :ttl_s)
    WHERE owner = :caller AND key = :idem_key AND state = 'running' AND claim_id = :claim
    RETURNING 1
""")
# The claims a replica's writes hold, kept alive while they run (TURN_LEASE_S each).
# By owner: on Citus made once per owner (Adapter.each_group), on the coordinator's own
# table. A claim is one attempt's: the keys and claims pair up.
RENEW = sql("""
    UPDATE idempotency_keys SET expires_at = CAST(:until AS timestamptz)
    WHERE owner = ANY(CAST(:owners AS text[])) AND key = ANY(CAST(:keys AS text[]))
        AND state = 'running' AND claim_id = ANY(CAST(:claims AS uuid[]))
""")
RELEASE_RUN = sql("""
    DELETE FROM idempotency_keys WHERE owner = :owner AND turn_id = :turn_id AND state = 'running'
""")
# The keys that committed to a deleted conversation (on plain PostgreSQL its foreign key does
# this first; on Citus, where the keys are the coordinator's and the conversations the
# workers', there is none: deleting does it).
DELETE_OF = sql("DELETE FROM idempotency_keys WHERE owner = :caller AND conversation_id = :cid")
# Past their TTL (a claim's lease that ran out too), but not a claim in doubt (receipts.py:
# on Citus, recorded with the conversation it writes) before its TTL: a retry settles it.
EXPIRED = sql("""
    DELETE FROM idempotency_keys WHERE expires_at < now() AND (
        state = 'done' OR writing IS NULL
        OR created_at < now() - make_interval(secs => CAST(:ttl_s AS double precision))
    )
""")
DELETE_OWNED = sql("DELETE FROM idempotency_keys WHERE owner = :owner")


def key_params(key: IdempotencyKey, data_key: DataKey | None = None) -> dict[str, Any]:
    """The statements' parameters; with encryption the request hash is kept keyed by the
    owner's data key (a plain hash of a short message would confirm a guess of it)."""
    stored = data_key.digest(key.request_hash) if data_key else key.request_hash
    return {"caller": key.owner, "idem_key": key.key, "request_hash": stored, "claim": key.claim}


def answer(row: Any, key: IdempotencyKey, data_key: DataKey | None = None) -> Committed:
    """What an existing record means for ``key``: its commit, or the error to raise. A hash
    stored in either form matches (a key claimed before encryption was switched on)."""
    hashes = {key.request_hash, data_key.digest(key.request_hash) if data_key else None}
    if row["request_hash"] not in hashes:
        raise IdempotencyKeyReused()
    if row["state"] != "done":
        raise RequestInProgress(turn_id=row["turn_id"])
    return Committed(row["conversation_id"], row["revision"], row["turn_id"])


async def complete(
    conn: Any, key: IdempotencyKey | None, cid: Any, revision: int | None, ttl_s: float
) -> None:
    """In a write's transaction: its key (if any) names what it did (``cid`` None: a
    deletion). RequestInProgress, and the write rolled back, when this attempt no longer
    holds the key's claim (it ran out, and another attempt took it over)."""
    if key is None:
        return
    completed = await COMPLETE.fetchval(
        conn,
        {
            "caller": key.owner,
            "idem_key": key.key,
            "claim": key.claim,
            "done_cid": cid,
            "done_revision": revision,
            "ttl_s": ttl_s,
        },
    )
    if completed is None:
        raise RequestInProgress()
