"""turnstore_secrets: the deployment's own random keys; owner_tombstones: shredded owners, by a
keyed digest

- ``turnstore_secrets``: one row per purpose, each 32 random bytes made here, once per
  deployment, read by every replica: ``ids`` keys the ids turnstore mints (opaque: they
  reveal neither a conversation nor a revision), ``owners`` keys the digest an owner is named
  by in a tombstone (never in clear). On Citus a reference table (a commit reads it on the
  worker of its conversation).
- ``owner_tombstones``: one row per shredded owner (``turnstore owners shred``), named by
  ``sha256(owners secret || owner)``; a commit, a new conversation, a fork or a running
  turn's place of an owner named here writes nothing. On Citus a reference table.
- ``turnstore_commit()`` and ``turnstore_take_turn()`` replaced, their signatures as they
  were, so that both refuse a shredded owner (SQLSTATE TSSHR) inside the one statement a
  write makes: a turn in flight when its owner is shredded can never commit after the shred.
  The release before this one calls the same functions: its replicas refuse too.

Expand only: two new tables, and two functions replaced with the same signatures. The
downgrade drops the tables and puts 0018's functions back: what it loses is the deployment's
keys (ids minted under them name nothing afterwards) and the tombstones (a shredded owner's
name could write again).

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
    op.execute(
        commit_function.definition(counts_revision=True, replace=True, refuses_shredded=True)
    )
    op.execute(TAKE_TURN.replace("{refusal}", commit_function.refuse_shredded("p_owner")))


def downgrade() -> None:
    op.execute(TAKE_TURN.replace("{refusal}", ""))
    op.execute(commit_function.definition(counts_revision=True, replace=True))
    op.drop_table("owner_tombstones")
    op.drop_table("turnstore_secrets")


def losses(connection: Connection) -> dict[str, int]:
    """The tombstones of shredded owners, and the deployment's keys once anything was
    minted under them (with a turn stored, an id shown for it then names nothing)."""
    minted = live.count(connection, "turns") > 0
    return live.nonzero(
        {
            "turnstore_secrets": live.count(connection, "turnstore_secrets") if minted else 0,
            "owner_tombstones": live.count(connection, "owner_tombstones"),
        }
    )
