"""turnstore_secrets: the deployment's own random keys; owner_tombstones: shredded owners, by a
keyed digest; turnstore_commit_v2: a turn's sizes kept with it, and its Idempotency-Key's claim

- ``turnstore_secrets``: one row per purpose, each 32 random bytes made here, once per
  deployment, read by every replica: ``ids`` keys the ids turnstore mints (opaque: they
  reveal neither a conversation nor a revision), ``owners`` keys the digest an owner is named
  by in a tombstone (never in clear). On Citus a reference table (a commit reads it on the
  worker of its conversation).
- ``owner_tombstones``: one row per shredded owner (``turnstore owners shred``), named by
  ``sha256(owners secret || owner)``; a commit, a new conversation, a fork or a running
  turn's place of an owner named here writes nothing. On Citus a reference table. Both are
  placed here already when the conversations are distributed (a commit on a worker reads
  them from the moment this migration is done, before ``db distribute`` runs again).
- ``turnstore_commit()`` and ``turnstore_take_turn()`` replaced, their signatures as they
  were, so that both refuse a shredded owner (SQLSTATE TSSHR) inside the one statement a
  write makes: the release before this one calls them, and its turns are refused too.
- ``turnstore_commit_v2()``, which this release calls: it refuses a shredded owner, stores a
  turn's sizes with it (``turns.items_bytes``, ``opaque_bytes``: what its items take in a
  request, so that a turn's window read measures them without reading them; ``turn_bytes``:
  all it stores), keeps the conversation's size as this release counts it
  (``conversations.counted_bytes``, ``counted_revision``: every stored column; the older
  ``stored_bytes`` counted only items, and the release before this one goes on writing it),
  and completes the turn's Idempotency-Key only if this attempt still holds its claim
  (``idempotency_keys.claim_id``; SQLSTATE TSKEY otherwise).

Expand only: new tables, nullable columns without defaults, each added in a transaction of
its own, a new function and two replaced with the same signatures. Rows written before have
no sizes: they are measured as before, once. The downgrade drops what this made and puts
0018's functions back: what it loses is the deployment's keys (ids minted under them name
nothing afterwards), the tombstones (a shredded owner's name could write again), the sizes
(counted again) and which attempt holds a running Idempotency-Key.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import os
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PURPOSES = ("ids", "owners")

# Frozen: the text this migration runs, as it ran when released (migrations/__init__.py).
# A line ending in a backslash goes on in the next one; one ending in \n\ ends in spaces.
# What a function that writes for an owner does first (``{owner}``: the argument naming the
# owner): a shredded owner's write raises SQLSTATE TSSHR.
REFUSAL = """IF EXISTS (SELECT 1 FROM owner_tombstones WHERE owner_tombstones.digest = \
sha256((SELECT secret FROM turnstore_secrets WHERE name = 'owners')
    || convert_to(CAST({owner} AS text), 'UTF8'))) THEN
        RAISE EXCEPTION 'the owner was shredded' USING ERRCODE = 'TSSHR';
    END IF;"""

# 0018's turnstore_take_turn(), with the shred's refusal first (``{refusal}``: none in 0018's).
TAKE_TURN = """
CREATE OR REPLACE FUNCTION turnstore_take_turn(p_owner text, p_holder uuid, p_now timestamptz,
    p_until timestamptz, p_most integer, OUT taken boolean)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_live boolean;
    v_start integer;
    v_place integer;
BEGIN
    {refusal}
    IF p_most IS NULL THEN
        taken := true;
        RETURN;
    END IF;
    SELECT until > p_now INTO v_live FROM owner_turns
    WHERE owner = p_owner AND holder = p_holder;
    IF v_live THEN
        UPDATE owner_turns SET until = p_until WHERE owner = p_owner AND holder = p_holder;
        taken := true;
        RETURN;
    ELSIF NOT v_live THEN
        DELETE FROM owner_turns WHERE owner = p_owner AND holder = p_holder;
    END IF;
    v_start := floor(random() * p_most)::integer;
    FOR v_round IN 1..2 LOOP
        FOR i IN 0 .. p_most - 1 LOOP
            v_place := (v_start + i) % p_most + 1;
            INSERT INTO owner_turns (owner, place, holder, until)
            VALUES (p_owner, v_place, p_holder, p_until)
            ON CONFLICT (owner, place) DO NOTHING;
            IF FOUND THEN
                taken := true;
                RETURN;
            END IF;
        END LOOP;
        EXIT WHEN v_round = 2;
        DELETE FROM owner_turns WHERE owner = p_owner AND place IN (
            SELECT place FROM owner_turns
            WHERE owner = p_owner AND until <= p_now
            FOR UPDATE SKIP LOCKED
        );
        EXIT WHEN NOT FOUND;
    END LOOP;
    taken := false;
END
$$
"""
# 0018's turnstore_commit(), its signature as it was, with the shred's refusal first
# (``{refusal}``: none in 0018's, which the downgrade puts back).
COMMIT = """
CREATE OR REPLACE FUNCTION turnstore_commit(p_cid uuid, p_expected integer, p_caller text, \
p_holder uuid, p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, \
p_stored_bytes bigint, p_user_message text, p_assistant_message text, p_replay_items json, \
p_provider text, p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, \
p_tool_calls json, p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message \
bytea, p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, \
p_usage json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response \
bytea, p_compacted json, p_sealed_compacted bytea, p_idem_key text, p_ttl_s double precision,
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    v_cutoff timestamptz := v_now - make_interval(secs => p_idle_s);
    v_head record;
BEGIN
    {refusal}
    IF p_expected = 0 THEN
        INSERT INTO conversations AS c (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted,
            expires_at, stored_bytes, stored_revision
        ) VALUES (
            p_cid, 1, v_now, v_now, p_context_start, p_caller, false, p_expires_at,
            p_stored_bytes, CASE WHEN p_stored_bytes IS NOT NULL THEN 1 END
        )
        ON CONFLICT (id) DO UPDATE SET
            revision = 1, updated_at = v_now, context_start = excluded.context_start,
            lease_holder = NULL, lease_expires_at = NULL, stored_bytes = excluded.stored_bytes,
            stored_revision = excluded.stored_revision
        WHERE c.revision = 0 AND c.owner = p_caller AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    ELSE
        UPDATE conversations AS c SET
            revision = c.revision + 1,
            updated_at = v_now,
            context_start = greatest(c.context_start, p_context_start),
            lease_holder = NULL,
            lease_expires_at = NULL,
            expires_at = CASE WHEN c.expires_at IS NOT NULL THEN p_expires_at END,
            stored_bytes = p_stored_bytes,
            stored_revision = CASE WHEN p_stored_bytes IS NOT NULL THEN c.revision + 1 END
        WHERE c.id = p_cid AND c.revision = p_expected AND c.owner = p_caller
            AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turns (conversation_id, seq, created_at, user_message, assistant_message, \
replay_items, provider, endpoint, model, context_from, prompt_version, tool_calls, status, \
incomplete_reason, turn_id, sealed_user_message, sealed_assistant_message, sealed_replay_items, \
sealed_tool_calls, usage, transcript, sealed_transcript, response, sealed_response, compacted, \
sealed_compacted)
    VALUES (p_cid, v_head.revision, v_now, p_user_message, p_assistant_message, p_replay_items, \
p_provider, p_endpoint, p_model, p_context_from, p_prompt_version, p_tool_calls, p_status, \
p_incomplete_reason, p_turn_id, p_sealed_user_message, p_sealed_assistant_message, \
p_sealed_replay_items, p_sealed_tool_calls, p_usage, p_transcript, p_sealed_transcript, \
p_response, p_sealed_response, p_compacted, p_sealed_compacted);
    IF p_idem_key IS NOT NULL THEN
        UPDATE idempotency_keys AS k SET
            state = 'done', conversation_id = p_cid, revision = v_head.revision,
            expires_at = v_now + make_interval(secs => p_ttl_s)
        WHERE k.owner = p_caller AND k.key = p_idem_key ;
    END IF;
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
    RETURN NEXT;
END
$$
"""
# turnstore_commit_v2(), which this release calls (the module's docstring).
COMMIT_V2 = """
CREATE FUNCTION turnstore_commit_v2(p_cid uuid, p_expected integer, p_caller text, p_holder uuid, \
p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, p_stored_bytes \
bigint, p_user_message text, p_assistant_message text, p_replay_items json, p_provider text, \
p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, p_tool_calls json, \
p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message bytea, \
p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, p_usage \
json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response bytea, \
p_compacted json, p_sealed_compacted bytea, p_items_bytes integer, p_opaque_bytes integer, \
p_turn_bytes bigint, p_idem_key text, p_ttl_s double precision, p_claim uuid,
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := now();
    v_cutoff timestamptz := v_now - make_interval(secs => p_idle_s);
    v_head record;
BEGIN
    {refusal}
    IF p_expected = 0 THEN
        INSERT INTO conversations AS c (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted,
            expires_at, counted_bytes, counted_revision
        ) VALUES (
            p_cid, 1, v_now, v_now, p_context_start, p_caller, false, p_expires_at,
            p_stored_bytes, CASE WHEN p_stored_bytes IS NOT NULL THEN 1 END
        )
        ON CONFLICT (id) DO UPDATE SET
            revision = 1, updated_at = v_now, context_start = excluded.context_start,
            lease_holder = NULL, lease_expires_at = NULL, counted_bytes = excluded.counted_bytes,
            counted_revision = excluded.counted_revision
        WHERE c.revision = 0 AND c.owner = p_caller AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    ELSE
        UPDATE conversations AS c SET
            revision = c.revision + 1,
            updated_at = v_now,
            context_start = greatest(c.context_start, p_context_start),
            lease_holder = NULL,
            lease_expires_at = NULL,
            expires_at = CASE WHEN c.expires_at IS NOT NULL THEN p_expires_at END,
            counted_bytes = p_stored_bytes,
            counted_revision = CASE WHEN p_stored_bytes IS NOT NULL THEN c.revision + 1 END
        WHERE c.id = p_cid AND c.revision = p_expected AND c.owner = p_caller
            AND \n\
    (c.expires_at IS NULL OR c.expires_at > v_now)
    AND (v_cutoff IS NULL OR c.updated_at > v_cutoff)
    AND (c.lease_holder IS NULL OR c.lease_expires_at <= v_now OR c.lease_holder = p_holder)

        RETURNING c.revision, c.created_at, c.updated_at, c.lease_wanted INTO v_head;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turns (conversation_id, seq, created_at, user_message, assistant_message, \
replay_items, provider, endpoint, model, context_from, prompt_version, tool_calls, status, \
incomplete_reason, turn_id, sealed_user_message, sealed_assistant_message, sealed_replay_items, \
sealed_tool_calls, usage, transcript, sealed_transcript, response, sealed_response, compacted, \
sealed_compacted, items_bytes, opaque_bytes, turn_bytes)
    VALUES (p_cid, v_head.revision, v_now, p_user_message, p_assistant_message, p_replay_items, \
p_provider, p_endpoint, p_model, p_context_from, p_prompt_version, p_tool_calls, p_status, \
p_incomplete_reason, p_turn_id, p_sealed_user_message, p_sealed_assistant_message, \
p_sealed_replay_items, p_sealed_tool_calls, p_usage, p_transcript, p_sealed_transcript, \
p_response, p_sealed_response, p_compacted, p_sealed_compacted, p_items_bytes, p_opaque_bytes, \
p_turn_bytes);
    IF p_idem_key IS NOT NULL THEN
        UPDATE idempotency_keys AS k SET
            state = 'done', conversation_id = p_cid, revision = v_head.revision,
            expires_at = v_now + make_interval(secs => p_ttl_s)
        WHERE k.owner = p_caller AND k.key = p_idem_key AND k.state = 'running' AND k.claim_id = \
p_claim;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'the claim of this Idempotency-Key was lost' USING ERRCODE = 'TSKEY';
        END IF;
    END IF;
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
    RETURN NEXT;
END
$$
"""
SIGNATURE_V2 = (
    "uuid, integer, text, uuid, integer, timestamptz, double precision, bigint, text, text, "
    "json, text, text, text, integer, text, json, text, text, uuid, bytea, bytea, bytea, bytea, "
    "json, json, bytea, json, bytea, json, bytea, integer, integer, bigint, text, "
    "double precision, uuid"
)


def refusal(owner: str) -> str:
    return REFUSAL.replace("{owner}", owner)


COLUMNS = (
    ("conversations", "counted_bytes", "bigint"),
    ("conversations", "counted_revision", "integer"),
    ("turns", "items_bytes", "integer"),
    ("turns", "opaque_bytes", "integer"),
    ("turns", "turn_bytes", "bigint"),
    ("idempotency_keys", "claim_id", "uuid"),
)
REFERENCES = ("turnstore_secrets", "owner_tombstones")


def upgrade() -> None:
    op.create_table(
        "turnstore_secrets",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("secret", sa.LargeBinary, nullable=False),
    )
    secrets = sa.table("turnstore_secrets", sa.column("name"), sa.column("secret"))
    op.bulk_insert(secrets, [{"name": name, "secret": os.urandom(32)} for name in PURPOSES])
    op.create_table(
        "owner_tombstones",
        sa.Column("digest", sa.LargeBinary, primary_key=True),
        sa.Column("shredded_at", sa.DateTime(timezone=True), nullable=False),
    )
    if live.distributed(op.get_bind()):
        op.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
        for table in REFERENCES:
            op.execute(f"SELECT create_reference_table('{table}')")
    for table, column, kind in COLUMNS:
        live.add_column_alone(op, table, column, kind)
    op.execute(COMMIT.replace("{refusal}", refusal("p_caller")))
    op.execute(COMMIT_V2.replace("{refusal}", refusal("p_caller")))
    op.execute(TAKE_TURN.replace("{refusal}", refusal("p_owner")))


def downgrade() -> None:
    op.execute(TAKE_TURN.replace("{refusal}", ""))
    op.execute(f"DROP FUNCTION turnstore_commit_v2({SIGNATURE_V2})")
    op.execute(COMMIT.replace("{refusal}", ""))
    for table, column, _ in reversed(COLUMNS):
        op.drop_column(table, column)
    op.drop_table("owner_tombstones")
    op.drop_table("turnstore_secrets")


def losses(connection: Connection) -> dict[str, int]:
    """The tombstones of shredded owners, and the deployment's keys once anything was minted
    under them (with a turn stored, an id shown for it then names nothing). The sizes are
    counted again and a running claim stays claimed: no loss."""
    minted = live.count(connection, "turns") > 0
    return live.nonzero(
        {
            "turnstore_secrets": live.count(connection, "turnstore_secrets") if minted else 0,
            "owner_tombstones": live.count(connection, "owner_tombstones"),
        }
    )
