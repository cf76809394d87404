"""turnstore_commit(): a turn's commit as one function, so Citus runs it on one worker

A turn's commit (the conditional bump of its conversation, or the new conversation of its
first turn; its turn row; its Idempotency-Key completed) was one statement of CTEs. On Citus
that statement is split: the bumped row comes back to the coordinator and is copied to a
worker to insert the turn, and every plain turn became a two-phase commit. As a function
distributed with the conversations (``turnstore db distribute``: colocated with
``conversations``, distributed by its first argument), an autocommitted ``SELECT * FROM
turnstore_commit(...)`` is sent whole to the worker holding the conversation: one round trip,
one local transaction. On plain PostgreSQL the same function is the one code path.

The function computes ``now()`` once and passes it, and the retention's cutoff, to its
statements as values: Citus refuses ``now()`` (and ``timestamptz - interval``, STABLE) in an
``ON CONFLICT DO UPDATE``.

Expand only: a function nothing of the release before this one calls. Its downgrade drops
it and loses no data.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs, as it ran when released (migrations/__init__.py).
# A line ending in a backslash goes on in the next one; one ending in \n\ ends in spaces.
FUNCTION = """
CREATE FUNCTION turnstore_commit(p_cid uuid, p_expected integer, p_caller text, p_holder uuid, \
p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, p_stored_bytes \
bigint, p_user_message text, p_assistant_message text, p_replay_items json, p_provider text, \
p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, p_tool_calls json, \
p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message bytea, \
p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, p_usage \
json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response bytea, \
p_compacted json, p_sealed_compacted bytea, p_idem_key text, p_ttl_s double precision,
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
SIGNATURE = (
    "uuid, integer, text, uuid, integer, timestamptz, double precision, bigint, text, text, "
    "json, text, text, text, integer, text, json, text, text, uuid, bytea, bytea, bytea, bytea, "
    "json, json, bytea, json, bytea, json, bytea, text, double precision"
)


def upgrade() -> None:
    op.execute(FUNCTION)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION turnstore_commit({SIGNATURE})")


def losses(connection: Connection) -> dict[str, int]:
    """A function: no data."""
    return live.nonzero({})
