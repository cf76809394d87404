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

from migrations import commit_function, live

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

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
    op.execute(commit_function.definition(counts_revision=True, replace=True))


def downgrade() -> None:
    op.execute(commit_function.definition(counts_revision=False, replace=True))
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
