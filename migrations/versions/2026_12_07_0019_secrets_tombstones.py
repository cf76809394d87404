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

from migrations import commit_function, live

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PURPOSES = ("ids", "owners")

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
    if _distributed(op.get_bind()):
        op.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
        for table in REFERENCES:
            op.execute(f"SELECT create_reference_table('{table}')")
    for table, column, kind in COLUMNS:
        live.add_column_alone(op, table, column, kind)
    op.execute(
        commit_function.definition(counts_revision=True, replace=True, refuses_shredded=True)
    )
    op.execute(commit_function.definition(counts_revision=True, refuses_shredded=True, v2=True))
    op.execute(TAKE_TURN.replace("{refusal}", commit_function.refuse_shredded("p_owner")))


def downgrade() -> None:
    op.execute(TAKE_TURN.replace("{refusal}", ""))
    op.execute(f"DROP FUNCTION turnstore_commit_v2({commit_function.SIGNATURE_V2})")
    op.execute(commit_function.definition(counts_revision=True, replace=True))
    for table, column, _ in reversed(COLUMNS):
        op.drop_column(table, column)
    op.drop_table("owner_tombstones")
    op.drop_table("turnstore_secrets")


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
