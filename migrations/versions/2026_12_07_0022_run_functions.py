"""turnstore_create_run, turnstore_log_run, turnstore_end_run, turnstore_commit_run: a durable
turn's writes of its run, each one function on its conversation's worker

A durable turn (streamed, background, /v1 streamed) makes its run's row unless its owner was
shredded, then writes the row and a batch of its events together: while it streams (a batch
logged), when it ends without a commit (failed, cancelled), and in its commit (the turn, then
the run's end and its ``message.done``). As statements, the first was an INSERT ... SELECT that
reads the tombstones (Citus runs it through the coordinator, with a two-phase commit); the next
two an UPDATE and an INSERT in one statement's CTEs, and the commit a transaction around the
commit function and such a statement. Citus never routes a statement whose CTE inserts: each
CTE runs as a step of its own and its rows are sent to the workers, so each of those writes
was a two-phase commit on every worker (4.4 prepared transactions per streamed turn with two
workers: issue 33).

As functions distributed by their conversation (``p_cid``, with ``conversations``), each is
sent whole to the worker of the conversation when called on its own, and runs there as one
local transaction: one round trip, no two-phase commit. On plain PostgreSQL they are the same
statements in one round trip (the durable commit: one instead of four).

- ``turnstore_create_run(cid, id, owner, background, hb, response, sealed_response)``: the
  run, queued, alive for ``hb`` seconds; SQLSTATE ``TSSHR`` (nothing made) when the owner was
  shredded.
- ``turnstore_log_run(cid, id, last, message_id, events, sealed_events)``: the run, if
  unfinished, moves to event ``last`` (in progress, its message's id kept once known) and the
  batch is written unless it was already (a retry); ``written`` (0 or 1) and ``watched``, no
  row when the run had ended.
- ``turnstore_end_run(cid, id, status, code, message, last, revision, ttl, events,
  sealed_events)``: the same for the run's end without a commit.
- ``turnstore_commit_run(<turnstore_commit_v3's arguments>, run, run_status, done_seq,
  events_ttl_s, events, sealed_events)``: ``turnstore_commit_v3()``, then the run's end at the
  revision it made and its last batch; no row when the commit found none (nothing ended), and
  SQLSTATE ``TSRUN`` (all rolled back) when the run had ended meanwhile (interrupted).

A NULL ``cid`` (a run whose conversation the caller does not know) finds the run by its id
alone (on Citus then run on the coordinator, over every shard). Writes are not waited for by a
synchronous standby or their WAL flush, except the commit's (``synchronous_commit`` off for the
others, as the statements did).

Expand only: four new functions the previous release never calls. On a Citus coordinator
whose conversations are distributed they are distributed here (``db distribute`` does it
otherwise). The downgrade drops them: nothing stored is lost.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs, as it ran when released (migrations/__init__.py).
# 0019's refusal of a shredded owner's write.
REFUSAL = """IF EXISTS (SELECT 1 FROM owner_tombstones WHERE owner_tombstones.digest = \
sha256((SELECT secret FROM turnstore_secrets WHERE name = 'owners')
    || convert_to(CAST(p_owner AS text), 'UTF8'))) THEN
        RAISE EXCEPTION 'the owner was shredded' USING ERRCODE = 'TSSHR';
    END IF;"""
CREATE_RUN = f"""
CREATE FUNCTION turnstore_create_run(p_cid uuid, p_id uuid, p_owner text, p_background boolean,
    p_hb double precision, p_response json, p_sealed_response bytea)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    {REFUSAL}
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO turn_runs (id, conversation_id, owner, background, status, heartbeat_until,
        created_at, last_event, cancel_requested, watched, response, sealed_response)
    VALUES (p_id, p_cid, p_owner, p_background, 'queued', now() + make_interval(secs => p_hb),
        now(), 0, false, false, p_response, p_sealed_response);
    RETURN true;
END
$$
"""
LOG_RUN = """
CREATE FUNCTION turnstore_log_run(p_cid uuid, p_id uuid, p_last integer, p_message_id text,
    p_events json, p_sealed_events bytea, OUT written integer, OUT watched boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_run record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE turn_runs AS r SET
        last_event = p_last, message_id = coalesce(r.message_id, p_message_id),
        status = CASE WHEN r.status = 'queued' THEN 'in_progress' ELSE r.status END
    WHERE r.id = p_id AND (p_cid IS NULL OR r.conversation_id = p_cid)
        AND r.status IN ('queued', 'in_progress')
    RETURNING r.conversation_id, r.watched INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turn_events (conversation_id, turn_id, seq, events, sealed_events)
    VALUES (v_run.conversation_id, p_id, p_last, p_events, p_sealed_events)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS written = ROW_COUNT;
    watched := v_run.watched;
    RETURN NEXT;
END
$$
"""
END_RUN = """
CREATE FUNCTION turnstore_end_run(p_cid uuid, p_id uuid, p_status text, p_code text,
    p_message text, p_last integer, p_revision integer, p_ttl double precision, p_events json,
    p_sealed_events bytea, OUT written integer, OUT watched boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_run record;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE turn_runs AS r SET
        status = p_status, error_code = p_code, error_message = p_message, last_event = p_last,
        revision = p_revision, finished_at = now(),
        expires_at = now() + make_interval(secs => p_ttl)
    WHERE r.id = p_id AND (p_cid IS NULL OR r.conversation_id = p_cid)
        AND r.status IN ('queued', 'in_progress')
    RETURNING r.conversation_id, r.watched INTO v_run;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO turn_events (conversation_id, turn_id, seq, events, sealed_events)
    VALUES (v_run.conversation_id, p_id, p_last, p_events, p_sealed_events)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS written = ROW_COUNT;
    watched := v_run.watched;
    RETURN NEXT;
END
$$
"""
# turnstore_commit_v3's arguments (migration 0021), then the run's.
V3_ARGUMENTS = """p_cid uuid, p_expected integer, p_caller text, p_holder uuid, \
p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, p_stored_bytes \
bigint, p_user_message text, p_assistant_message text, p_replay_items json, p_provider text, \
p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, p_tool_calls json, \
p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message bytea, \
p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, p_usage \
json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response bytea, \
p_compacted json, p_sealed_compacted bytea, p_items_bytes integer, p_opaque_bytes integer, \
p_turn_bytes bigint, p_idem_key text, p_ttl_s double precision, p_claim uuid, p_kind text, \
p_key_fingerprint text, p_search_text text, p_search_terms text[]"""
V3_CALL = """p_cid, p_expected, p_caller, p_holder, p_context_start, p_expires_at, p_idle_s, \
p_stored_bytes, p_user_message, p_assistant_message, p_replay_items, p_provider, p_endpoint, \
p_model, p_context_from, p_prompt_version, p_tool_calls, p_status, p_incomplete_reason, \
p_turn_id, p_sealed_user_message, p_sealed_assistant_message, p_sealed_replay_items, \
p_sealed_tool_calls, p_usage, p_transcript, p_sealed_transcript, p_response, p_sealed_response, \
p_compacted, p_sealed_compacted, p_items_bytes, p_opaque_bytes, p_turn_bytes, p_idem_key, \
p_ttl_s, p_claim, p_kind, p_key_fingerprint, p_search_text, p_search_terms"""
COMMIT_RUN = f"""
CREATE FUNCTION turnstore_commit_run({V3_ARGUMENTS}, p_run uuid, p_run_status text,
    p_done_seq integer, p_events_ttl_s double precision, p_events json, p_sealed_events bytea,
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean, OUT watched boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_head record;
BEGIN
    SELECT * INTO v_head FROM turnstore_commit_v3({V3_CALL});
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE turn_runs AS r SET
        status = p_run_status, revision = v_head.revision, last_event = p_done_seq,
        finished_at = now(), expires_at = now() + make_interval(secs => p_events_ttl_s)
    WHERE r.conversation_id = p_cid AND r.id = p_run AND r.status IN ('queued', 'in_progress')
    RETURNING r.watched INTO watched;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the turn''s run had ended' USING ERRCODE = 'TSRUN';
    END IF;
    INSERT INTO turn_events (conversation_id, turn_id, seq, events, sealed_events)
    VALUES (p_cid, p_run, p_done_seq, p_events, p_sealed_events);
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
    RETURN NEXT;
END
$$
"""
V3_SIGNATURE = (
    "uuid, integer, text, uuid, integer, timestamptz, double precision, bigint, text, text, "
    "json, text, text, text, integer, text, json, text, text, uuid, bytea, bytea, bytea, bytea, "
    "json, json, bytea, json, bytea, json, bytea, integer, integer, bigint, text, "
    "double precision, uuid, text, text, text, text[]"
)
SIGNATURES = {
    "turnstore_create_run": "uuid, uuid, text, boolean, double precision, json, bytea",
    "turnstore_log_run": "uuid, uuid, integer, text, json, bytea",
    "turnstore_end_run": (
        "uuid, uuid, text, text, text, integer, integer, double precision, json, bytea"
    ),
    "turnstore_commit_run": (f"{V3_SIGNATURE}, uuid, text, integer, double precision, json, bytea"),
}


def upgrade() -> None:
    for function in (CREATE_RUN, LOG_RUN, END_RUN, COMMIT_RUN):
        op.execute(function)
    if live.distributed(op.get_bind()):
        for name, signature in SIGNATURES.items():
            op.execute(
                "SELECT create_distributed_function("
                f"'{name}({signature})', 'p_cid', colocate_with := 'conversations')"
            )


def downgrade() -> None:
    for name, signature in SIGNATURES.items():
        op.execute(f"DROP FUNCTION {name}({signature})")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing stored: functions only."""
    return live.nonzero({})
