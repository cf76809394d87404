"""owner_turns: each owner's running turns (OWNER_MAX_RUNNING_TURNS), and the function that
takes one

- ``owner_turns``: one row per running turn (its owner, its holder: the turn's lease holder
  or its run's id, and until when it counts unless renewed). A turn takes its row before the
  provider is called and its commit (or its end) deletes it; a replica that dies leaves rows
  that stop counting at ``until`` (TURN_LEASE_S after the last renewal). On Citus distributed
  by owner, with the Idempotency-Keys.
- ``turnstore_take_turn(owner, holder, now, until, most)``: the owner's turns are counted one
  at a time (a transaction lock per owner), each count in a snapshot taken after that lock,
  so two replicas never both take the 16th of 16. A holder that has its row already (a run
  whose lease statement takes it again) renews it, never counts twice. Whether it was taken,
  and when the earliest running turn of the owner stops counting at the latest.

Expand only: a new table and function the release before this one never uses (its turns are
not counted while it serves beside this one). The downgrade drops both: what it loses is the
count of turns running at that moment.

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

SIGNATURE = "text, uuid, timestamptz, timestamptz, integer"
# Rows that stopped counting are deleted by the next take, but never one a commit is deleting
# at that moment (SKIP LOCKED: a take never waits for a commit, so the two cannot deadlock).
FUNCTION = """
CREATE FUNCTION turnstore_take_turn(p_owner text, p_holder uuid, p_now timestamptz,
    p_until timestamptz, p_most integer, OUT taken boolean, OUT free_at timestamptz)
RETURNS record LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    UPDATE owner_turns SET until = p_until WHERE owner = p_owner AND holder = p_holder;
    IF FOUND OR p_most IS NULL THEN
        taken := true;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('turns:' || p_owner, 0));
    DELETE FROM owner_turns WHERE owner = p_owner AND holder IN (
        SELECT holder FROM owner_turns
        WHERE owner = p_owner AND until <= p_now
        FOR UPDATE SKIP LOCKED
    );
    SELECT count(*) < p_most, min(until) INTO taken, free_at
    FROM owner_turns WHERE owner = p_owner AND until > p_now;
    IF taken THEN
        INSERT INTO owner_turns (owner, holder, until) VALUES (p_owner, p_holder, p_until);
        free_at := NULL;
    END IF;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "owner_turns",
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("holder", sa.Uuid, nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "holder"),
    )
    op.execute(FUNCTION)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION turnstore_take_turn({SIGNATURE})")
    op.drop_table("owner_turns")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: the turns running right now stop counting."""
    return live.nonzero({"owner_turns": live.count(connection, "owner_turns", "true")})
