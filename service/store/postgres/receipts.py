"""A keyed write's receipt beside its conversation, so that on Citus an Idempotency-Key commits
once although it is completed without a two-phase commit (deploy/SCALE-OUT.md, "Each owner's
rows").

On Citus the keys are the coordinator's (``idempotency_keys``) and a conversation is a
worker's; a write that completes a key commits the two in one phase, the worker first. If the
coordinator then crashes, the key stays running with the write kept; if the worker's
acknowledgement of its ``COMMIT`` is lost, the coordinator's part rolls back and the attempt
releases its key: either way the key's outcome is in doubt. So:

- a claim records the conversation its attempt writes (``IdempotencyKey.conversation``; a
  write that makes one fixes its id before it claims), in ``idempotency_keys.writing``;
- the write's transaction writes its receipt on that conversation's worker
  (``idempotency_receipts``, migration 0024, distributed with the conversations): its claim,
  its owner and key, the revision it left (NULL: a deletion), expiring with the key's TTL. A
  turn's commit writes it in its one statement (``turnstore_commit_receipt()``, or
  ``turnstore_commit_run_receipt()``, statements.COMMIT_RECEIPT_CALL); every other write in its
  transaction (``write``);
- an attempt that did not commit does not free its key but lets its claim lapse (``RELEASE``):
  it cannot know whether the worker committed;
- a claim that finds a key still running, its lease run out, with a conversation recorded,
  reads that claim's receipt on the conversation's worker (one routed read): found, the key is
  completed from it and its answer replayed; not found, the write did not commit (the claim
  waited for any transaction that held the key's row, its commit included, and a later commit
  of that attempt finds its claim gone) and the key is claimed afresh. The coordinator's part
  of a commit can end before the worker's (its backend killed while the worker commits, the
  worker waiting for a synchronous standby), so before it reads, the claim writes a ``fence``
  in the receipt's place (``FENCE``: same key): that waits for a receipt still being
  committed, and a receipt not written yet can no longer be. With the worker down that fails:
  ``storage_error``, never a second write.

Receipts go with their key's TTL (``EXPIRED``, ``turnstore purge``) or with their conversation
(deleted, purged, its owner's rows deleted: ``delete_of``, ``delete_owned``). A deletion's own
receipt outlives its conversation until its TTL.

Plain PostgreSQL commits a write and its key in one transaction: nothing is ever in doubt, so it
neither writes nor reads receipts, records no conversation with a claim, and its statements and
round trips are as they were. Every choice between the two is made here.
"""

from __future__ import annotations

from typing import Any, Protocol
from uuid import UUID

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import OwnerShredded, RequestInProgress
from service.core.model import Committed, IdempotencyKey
from service.platform.crypto import DataKey
from service.store.postgres import idempotency as idem
from service.store.postgres.tx import Compiled, driver, sql


class Adapter(Protocol):
    """What receipts need of the store's Adapter (adapter.py, which writes them: not imported)."""

    engine: AsyncEngine

    async def distributed(self, conn: asyncpg.Connection | None = None) -> bool: ...


EXPIRES = "now() + make_interval(secs => CAST(:ttl_s AS double precision))"
COLUMNS = "conversation_id, claim_id, owner, key, revision, expires_at"
# A keyed write's receipt, in its transaction (``done_revision`` NULL: a deletion); a turn's
# commit writes its own in its function (turnstore_commit_receipt()).
WRITE = sql(f"""
    INSERT INTO idempotency_receipts ({COLUMNS})
    VALUES (CAST(:writing AS uuid), CAST(:claim AS uuid), CAST(:caller AS text),
        CAST(:idem_key AS text), CAST(:done_revision AS integer), {EXPIRES})
""")
# A claim that records the conversation it writes. Taken over when its lease ran out only if
# it is done (its TTL ran out) or recorded none (then nothing of it can be in doubt: a claim of
# the release before, or a write that does not know its conversation when it claims).
CLAIM = sql(idem.claim_text(writing=True))
# (Lapsed by the claims' own clock, :now, as CLAIM takes a claim over.)
EXISTING = sql(
    f"SELECT {idem.RECORD_FIELDS}, claim_id, writing,"
    f" expires_at < CAST(:now AS timestamptz) AS lapsed {idem.OF_KEY}"
)
# Before the claim in doubt's receipt is read: a fence in its place, under its key (on the
# conversation's worker). Its INSERT waits for a transaction still writing that receipt (the
# attempt's commit, still under way on the worker when the coordinator's part ended) and
# conflicts once it committed; once the fence is in, that write can no longer commit.
FENCE = sql(f"""
    INSERT INTO idempotency_receipts ({COLUMNS}, fence)
    VALUES (CAST(:writing AS uuid), CAST(:held AS uuid), CAST(:caller AS text),
        CAST(:idem_key AS text), NULL, {EXPIRES}, true)
    ON CONFLICT (conversation_id, claim_id) DO NOTHING
    RETURNING 1
""")
# The claim's receipt, on its conversation's worker (a fence: a retry's, it did not commit).
RECEIPT = sql("""
    SELECT revision, expires_at, fence FROM idempotency_receipts
    WHERE conversation_id = :writing AND claim_id = :held AND owner = :caller AND key = :idem_key
""")
# The key completed from its receipt (its row locked by the claim that found it in doubt).
SETTLE = sql(f"""
    UPDATE idempotency_keys SET
        state = 'done',
        conversation_id = CASE WHEN CAST(:done_revision AS integer) IS NULL THEN NULL
            ELSE CAST(:writing AS uuid) END,
        revision = :done_revision,
        expires_at = :done_expires
    WHERE owner = :caller AND key = :idem_key AND state = 'running' AND claim_id = :held
    RETURNING {idem.RECORD_FIELDS}
""")
# No receipt: the claim in doubt did not commit, and this attempt claims the key afresh.
TAKEOVER = sql("""
    UPDATE idempotency_keys SET
        request_hash = :request_hash, state = 'running', conversation_id = NULL,
        revision = NULL, turn_id = CAST(:claimed_turn AS uuid),
        created_at = CAST(:now AS timestamptz), expires_at = CAST(:until AS timestamptz),
        claim_id = CAST(:claim AS uuid), writing = CAST(:writing AS uuid)
    WHERE owner = :caller AND key = :idem_key AND state = 'running' AND claim_id = :held
    RETURNING 1
""")
# An attempt that did not commit: its claim lapses at once (a retry then settles it).
RELEASE = sql("""
    UPDATE idempotency_keys SET expires_at = '-infinity'
    WHERE owner = :caller AND key = :idem_key AND state = 'running' AND claim_id = :claim
""")
EXPIRED = sql("DELETE FROM idempotency_receipts WHERE expires_at < now()")
OF = sql("DELETE FROM idempotency_receipts WHERE conversation_id = ANY(CAST(:cids AS uuid[]))")
OWNED = sql("DELETE FROM idempotency_receipts WHERE owner = :owner")


async def claim(
    db: Adapter,
    key: IdempotencyKey,
    turn_id: UUID | None,
    data_key: DataKey | None,
    clock: dict[str, Any],
) -> Committed | None:
    """On Citus, ``key`` claimed for this attempt (None), or where an earlier one committed;
    a claim in doubt settled by its receipt first. ``clock``: the claim's ``now`` and
    ``until``, and ``ttl_s`` (IDEMPOTENCY_TTL_S: a fence's).

    One transaction: the claim's INSERT locks the key's row when it finds one (and waits for a
    transaction that holds it, such as a commit of the attempt in doubt still under way), so
    what is read of it, and of its receipt, stays so until this one has settled it or taken it
    over."""
    params = {
        **idem.key_params(key, data_key),
        **clock,
        "claimed_turn": turn_id,
        "writing": key.conversation,
    }
    async with driver(db.engine, write=True) as conn:
        if await CLAIM.fetchval(conn, params) is not None:
            return None
        row = await EXISTING.fetchrow(conn, params)  # locked by the claim: there
        if row is None:  # none made, none there: the owner was shredded
            raise OwnerShredded()
        if row["state"] == "running" and row["lapsed"] and row["writing"] is not None:
            held = {**params, "held": row["claim_id"], "writing": row["writing"]}
            fenced = await FENCE.fetchval(conn, held) is not None  # on the conversation's worker
            receipt = None if fenced else await RECEIPT.fetchrow(conn, held)
            if receipt is None or receipt["fence"]:  # it did not commit: this attempt's now
                if await TAKEOVER.fetchval(conn, {**held, "writing": key.conversation}):
                    return None
                raise RequestInProgress()  # (the row is locked: not expected)
            settle = {
                **held,
                "done_revision": receipt["revision"],
                "done_expires": receipt["expires_at"],
            }
            row = await SETTLE.fetchrow(conn, settle)
            if row is None:
                raise RequestInProgress()  # (the row is locked: not expected)
    return idem.answer(row, key, data_key)  # (an error raised once the key is settled)


async def releasing(db: Adapter, in_doubt: bool) -> Compiled:
    """What frees the key of an attempt that did not commit: on Citus, where it failed ``in
    doubt`` (its write may have committed on the worker all the same), its claim lapses, to be
    settled by the next claim; else, and on plain PostgreSQL, the key is freed."""
    return RELEASE if in_doubt and await db.distributed() else idem.RELEASE


async def write(
    db: Adapter, conn: asyncpg.Connection, key: IdempotencyKey, revision: int | None, ttl_s: float
) -> None:
    """On Citus, in a write's transaction that completes ``key``: its receipt, on the
    conversation its claim recorded (none recorded: none written, and a retry of it in doubt
    writes again, as before)."""
    if key.conversation is None or not await db.distributed(conn):
        return
    await WRITE.execute(
        conn,
        {
            "writing": key.conversation,
            "claim": key.claim,
            "caller": key.owner,
            "idem_key": key.key,
            "done_revision": revision,
            "ttl_s": ttl_s,
        },
    )


async def delete_of(db: Adapter, conn: asyncpg.Connection, cids: list[UUID]) -> None:
    """In a deletion's transaction, on Citus: the receipts of the conversations ``cids``."""
    if await db.distributed(conn):
        await OF.execute(conn, {"cids": cids})


async def delete_owned(db: Adapter, conn: asyncpg.Connection, owner: str) -> None:
    """In the deletion of an owner's rows, on Citus: their receipts left (their deletions')."""
    if await db.distributed(conn):
        await OWNED.execute(conn, {"owner": owner})


async def delete_expired(db: Adapter, conn: asyncpg.Connection) -> None:
    """On Citus, the receipts past their key's TTL (a DELETE on every shard)."""
    if await db.distributed(conn):
        await EXPIRED.execute(conn, {})
