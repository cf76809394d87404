"""owner_turns: each owner's running turns (OWNER_MAX_RUNNING_TURNS), and the function that
takes one; conversations.stored_revision: the revision ``stored_bytes`` counts

- ``owner_turns``: one row per running turn: its owner, its place (a number from 1 to the
  limit), its holder (the turn's lease holder, or its run's id) and until when it counts
  unless renewed. There are as many places as the limit, and the primary key (owner, place)
  makes two turns that race for one place wait for each other: one gets it, the other looks
  for another. So an owner never runs more turns than places, on any number of replicas, and
  no lock is taken on the owner as a whole (turns of one owner do not queue for each other).
  A turn takes its row before the provider is called and its commit (or its end) deletes it;
  a replica that dies leaves rows that stop counting at ``until`` (TURN_LEASE_S after the last
  renewal). On Citus distributed by owner, with the Idempotency-Keys.
- ``turnstore_take_turn(owner, holder, now, until, most)``: whether a place was free. A holder
  that has one already (a run, whose lease statement takes it again) renews it. The places
  are tried from a random one on, so turns that start together rarely try the same; rows that
  ran out are deleted only when no place is free. Neither that sweep nor a commit's delete of
  its place waits for a row the other holds (SKIP LOCKED), so the two cannot deadlock.
- ``conversations.stored_revision``: the revision up to which ``stored_bytes`` counts
  (MAX_CONVERSATION_BYTES), written with it by ``turnstore_commit()`` (replaced here, its
  signature as it was) and the other writes of it. A turn reads no more of its conversation
  than its window, so it cannot count the whole history again: where an older release's
  commits left the count behind, only the turns after ``stored_revision`` are counted.

Expand only: a new table, a function and a nullable column without default the release
before this one never uses (its turns are not counted while it serves beside this one, and
its commits leave ``stored_revision`` behind, which is how they are found). The downgrade
drops them and puts 0017's commit function back: what it loses is the count of turns running
at that moment and which revision each size counts (counted again after a new upgrade).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs, as it ran when released (migrations/__init__.py).
# A line ending in a backslash goes on in the next one; one ending in \n\ ends in spaces.
SIGNATURE = "text, uuid, timestamptz, timestamptz, integer"
FUNCTION = """
CREATE FUNCTION turnstore_take_turn(p_owner text, p_holder uuid, p_now timestamptz,
    p_until timestamptz, p_most integer, OUT taken boolean)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_live boolean;
    v_start integer;
    v_place integer;
BEGIN
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
    ELSIF NOT v_live THEN  -- it ran out: a place is taken afresh
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
# turnstore_commit() as this migration replaces it: it writes stored_revision too.
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
    \n\
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
# 0017's turnstore_commit(), which the downgrade puts back.
COMMIT_BEFORE = """
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
    \n\
    IF p_expected = 0 THEN
        INSERT INTO conversations AS c (
            id, revision, created_at, updated_at, context_start, owner, lease_wanted,
            expires_at, stored_bytes
        ) VALUES (
            p_cid, 1, v_now, v_now, p_context_start, p_caller, false, p_expires_at,
            p_stored_bytes
        )
        ON CONFLICT (id) DO UPDATE SET
            revision = 1, updated_at = v_now, context_start = excluded.context_start,
            lease_holder = NULL, lease_expires_at = NULL, stored_bytes = excluded.stored_bytes
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
            stored_bytes = p_stored_bytes
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


def upgrade() -> None:
    op.create_table(
        "owner_turns",
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("place", sa.Integer, nullable=False),
        sa.Column("holder", sa.Uuid, nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "place"),
        sa.UniqueConstraint("owner", "holder", name="owner_turns_holder_key"),
    )
    op.execute(FUNCTION)
    op.add_column("conversations", sa.Column("stored_revision", sa.Integer()))
    op.execute(COMMIT)


def downgrade() -> None:
    op.execute(COMMIT_BEFORE)
    op.drop_column("conversations", "stored_revision")
    op.execute(f"DROP FUNCTION turnstore_take_turn({SIGNATURE})")
    op.drop_table("owner_turns")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: the turns running right now stop counting, and which revision
    each conversation's size counts is forgotten (it is counted again)."""
    return live.nonzero(
        {
            "owner_turns": live.count(connection, "owner_turns", "true"),
            "conversations.stored_revision": live.count(
                connection, "conversations", "stored_revision IS NOT NULL"
            ),
        }
    )
