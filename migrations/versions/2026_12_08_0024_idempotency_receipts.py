"""idempotency_receipts: a keyed write's receipt beside its conversation (issue 44)

On Citus an Idempotency-Key (``idempotency_keys``) is the coordinator's and a conversation a
worker's: a write that completes a key commits the two in one phase (the worker first), so a
crash of the coordinator after the worker's commit, or a lost acknowledgement of it, left the
key running (or freed) with the write kept, and a retry wrote again.

- ``idempotency_receipts``: one row per keyed write, written in the write's own transaction on
  its conversation's worker (distributed by ``conversation_id`` with ``conversations``: by
  ``turnstore db distribute``, or here on a coordinator whose conversations are distributed
  already, while the table is empty): the attempt's claim, its owner and key, the revision it left
  (NULL: a deletion) and when it expires (with its key's TTL). A retry that finds a claim's
  outcome in doubt reads it there (service/store/postgres/receipts.py), after writing a
  ``fence`` of its own under the same key, which waits for a write of the receipt still
  committing and makes a later one fail. Plain PostgreSQL never
  writes nor reads it (its write and its key commit in one transaction).
- ``turnstore_commit_receipt(<turnstore_commit_v3's arguments>)`` and
  ``turnstore_commit_run_receipt(<turnstore_commit_run's>)``: the commit, then its receipt (a
  keyed turn's commit on Citus, run on the coordinator: its statements go to the
  conversation's worker, the receipt's INSERT with them, one phase). Never distributed.
- ``idempotency_keys.writing``: the conversation a claim will write (on Citus only), so that a
  retry knows which worker holds the receipt.

Expand only: a table and a nullable column the previous release never uses; its claims have no
``writing``, so a retry treats them as before. The downgrade drops both: what it loses is where
a claim in doubt would be settled (a retry runs it again, as before this release).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _names(arguments: str) -> str:
    """A function's call of its own arguments, from their declaration."""
    return ", ".join(argument.split()[0] for argument in arguments.split(", "))


def _types(arguments: str) -> str:
    """Its signature (the arguments' types), from the same."""
    return ", ".join(argument.split(maxsplit=1)[1] for argument in arguments.split(", "))


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
RUN_ARGUMENTS = f"""{V3_ARGUMENTS}, p_run uuid, p_run_status text, p_done_seq integer, \
p_events_ttl_s double precision, p_events json, p_sealed_events bytea"""
# The receipt of a commit that made a row (none: nothing committed, none written), on the
# conversation's worker: the function runs where it is called (on Citus the coordinator, in
# the keyed commit's CTE), and its INSERT goes to the worker its commit wrote, in the same
# transaction.
RECEIPT = """
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO idempotency_receipts
        (conversation_id, claim_id, owner, key, revision, expires_at)
    VALUES (p_cid, p_claim, p_caller, p_idem_key, v_head.revision,
        now() + make_interval(secs => p_ttl_s));
    revision := v_head.revision;
    created_at := v_head.created_at;
    updated_at := v_head.updated_at;
    lease_wanted := v_head.lease_wanted;
"""


def _with_receipt(name: str, arguments: str, commit: str, watched: bool) -> str:
    """A function ``name`` that runs ``commit`` (a function of ``arguments``), then RECEIPT;
    ``watched``: the commit answers whether its run is watched (a durable turn's)."""
    out, set_watched = (
        (", OUT watched boolean", "    watched := v_head.watched;\n") if watched else ("", "")
    )
    return f"""
CREATE FUNCTION {name}({arguments},
    OUT revision integer, OUT created_at timestamptz, OUT updated_at timestamptz,
    OUT lease_wanted boolean{out})
RETURNS SETOF record LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_head record;
BEGIN
    SELECT * INTO v_head FROM {commit}({_names(arguments)});
{RECEIPT}
{set_watched}    RETURN NEXT;
END
$$
"""


COMMIT_RECEIPT = _with_receipt(
    "turnstore_commit_receipt", V3_ARGUMENTS, "turnstore_commit_v3", watched=False
)
COMMIT_RUN_RECEIPT = _with_receipt(
    "turnstore_commit_run_receipt", RUN_ARGUMENTS, "turnstore_commit_run", watched=True
)
V3_SIGNATURE = _types(V3_ARGUMENTS)
SIGNATURES = {
    "turnstore_commit_receipt": V3_SIGNATURE,
    "turnstore_commit_run_receipt": _types(RUN_ARGUMENTS),
}


# Runs while the previous release serves: follow "Writing a migration" in deploy/README.md.
# Frozen once released: the SQL it runs is written here, never imported (migrations/__init__.py).
def upgrade() -> None:
    op.create_table(
        "idempotency_receipts",
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("claim_id", sa.Uuid, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("revision", sa.Integer, nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        # A retry's, where it found no receipt of the claim in doubt: the attempt's write, if
        # still committing on the worker, waits for it and fails on the same key.
        sa.Column("fence", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.PrimaryKeyConstraint("conversation_id", "claim_id"),
    )
    op.create_index("idempotency_receipts_expires", "idempotency_receipts", ["expires_at"])
    if live.distributed(op.get_bind()):  # placed now, empty: no `db distribute` needed for it
        op.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
        op.execute(
            "SELECT create_distributed_table('idempotency_receipts', 'conversation_id',"
            " colocate_with => 'conversations')"
        )
    live.add_column_alone(op, "idempotency_keys", "writing", "uuid")
    op.execute(COMMIT_RECEIPT)
    op.execute(COMMIT_RUN_RECEIPT)


def downgrade() -> None:
    for name, signature in SIGNATURES.items():
        op.execute(f"DROP FUNCTION {name}({signature})")
    op.drop_column("idempotency_keys", "writing")
    op.drop_table("idempotency_receipts")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: the receipts of keyed writes (a claim in doubt is run again)."""
    return live.nonzero(
        {"idempotency_receipts": live.count(connection, "idempotency_receipts", "true")}
    )
