"""turns.kind and turns.key_fingerprint: each turn records its provider's kind and which key
it was called with; turnstore_commit_v3 writes them

A turn's origin was its provider's name, endpoint and model. The contract's origin also names
the provider's kind (``openai``, ``azure``, ``anthropic``, ``fake``...) and a fingerprint of
the key it was called with (the start of the key's SHA-256: never the key), so that an
operator or an export tells which account made a turn's replay items. Neither tells one
origin from another (core/model.py's ``Origin``): a rotated key opens what the old one was
given.

- ``turns.kind``, ``turns.key_fingerprint``: nullable text; NULL on every turn written before
  (and by the previous release, which goes on calling ``turnstore_commit()``, and images built
  between 0019 and this, which call ``turnstore_commit_v2()``).
- ``turnstore_commit_v3()``, which this release calls: 0019's ``turnstore_commit_v2()`` with
  the two columns as its last two arguments. On Citus (conversations distributed already) it
  is distributed here, by ``p_cid`` with ``conversations`` as v2 is, so that this release's
  first commit after the upgrade runs on its conversation's worker before ``db distribute``
  runs again.

Expand only: two nullable columns without defaults, each in a transaction of its own, and a
new function. The downgrade drops the function and the columns: it loses the kinds and
fingerprints recorded.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen: the text this migration runs, as it ran when released (migrations/__init__.py).
# A line ending in a backslash goes on in the next one; one ending in \n\ ends in spaces.
# 0019's refusal of a shredded owner's write (``{owner}``: the argument naming the owner).
REFUSAL = """IF EXISTS (SELECT 1 FROM owner_tombstones WHERE owner_tombstones.digest = \
sha256((SELECT secret FROM turnstore_secrets WHERE name = 'owners')
    || convert_to(CAST({owner} AS text), 'UTF8'))) THEN
        RAISE EXCEPTION 'the owner was shredded' USING ERRCODE = 'TSSHR';
    END IF;"""
# turnstore_commit_v3(), which this release calls (the module's docstring).
COMMIT_V3 = """
CREATE FUNCTION turnstore_commit_v3(p_cid uuid, p_expected integer, p_caller text, p_holder uuid, \
p_context_start integer, p_expires_at timestamptz, p_idle_s double precision, p_stored_bytes \
bigint, p_user_message text, p_assistant_message text, p_replay_items json, p_provider text, \
p_endpoint text, p_model text, p_context_from integer, p_prompt_version text, p_tool_calls json, \
p_status text, p_incomplete_reason text, p_turn_id uuid, p_sealed_user_message bytea, \
p_sealed_assistant_message bytea, p_sealed_replay_items bytea, p_sealed_tool_calls bytea, p_usage \
json, p_transcript json, p_sealed_transcript bytea, p_response json, p_sealed_response bytea, \
p_compacted json, p_sealed_compacted bytea, p_items_bytes integer, p_opaque_bytes integer, \
p_turn_bytes bigint, p_idem_key text, p_ttl_s double precision, p_claim uuid, p_kind text, \
p_key_fingerprint text,
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
sealed_compacted, items_bytes, opaque_bytes, turn_bytes, kind, key_fingerprint)
    VALUES (p_cid, v_head.revision, v_now, p_user_message, p_assistant_message, p_replay_items, \
p_provider, p_endpoint, p_model, p_context_from, p_prompt_version, p_tool_calls, p_status, \
p_incomplete_reason, p_turn_id, p_sealed_user_message, p_sealed_assistant_message, \
p_sealed_replay_items, p_sealed_tool_calls, p_usage, p_transcript, p_sealed_transcript, \
p_response, p_sealed_response, p_compacted, p_sealed_compacted, p_items_bytes, p_opaque_bytes, \
p_turn_bytes, p_kind, p_key_fingerprint);
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
SIGNATURE_V3 = (
    "uuid, integer, text, uuid, integer, timestamptz, double precision, bigint, text, text, "
    "json, text, text, text, integer, text, json, text, text, uuid, bytea, bytea, bytea, bytea, "
    "json, json, bytea, json, bytea, json, bytea, integer, integer, bigint, text, "
    "double precision, uuid, text, text"
)

COLUMNS = (("turns", "kind", "text"), ("turns", "key_fingerprint", "text"))


def upgrade() -> None:
    for table, column, kind in COLUMNS:
        live.add_column_alone(op, table, column, kind)
    op.execute(COMMIT_V3.replace("{refusal}", REFUSAL.replace("{owner}", "p_caller")))
    if _distributed(op.get_bind()):
        op.execute(
            "SELECT create_distributed_function("
            f"'turnstore_commit_v3({SIGNATURE_V3})', 'p_cid', colocate_with := 'conversations')"
        )


def downgrade() -> None:
    op.execute(f"DROP FUNCTION turnstore_commit_v3({SIGNATURE_V3})")
    for table, column, _ in reversed(COLUMNS):
        op.drop_column(table, column)


def _distributed(bind: Connection) -> bool:
    """Whether this is a Citus coordinator whose conversations are distributed already."""
    if not bind.scalar(sa.text("SELECT to_regclass('pg_dist_partition') IS NOT NULL")):
        return False
    return bool(
        bind.scalar(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM pg_dist_partition"
                " WHERE logicalrelid = to_regclass('conversations'))"
            )
        )
    )


def losses(connection: Connection) -> dict[str, int]:
    """The kinds and key fingerprints turns recorded."""
    where = "kind IS NOT NULL OR key_fingerprint IS NOT NULL"
    return live.nonzero({"turns.kind/key_fingerprint": live.count(connection, "turns", where)})
