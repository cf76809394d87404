"""run_homes: each durable turn's conversation, found by the turn's id alone (issue 44)

On Citus a run (``turn_runs``) and its events live on the worker of their conversation, and the
public turn id does not carry the conversation (it must stay opaque). A replica that made or
read a run remembers its conversation; one that never saw it (behind a load balancer: a status
read, an events read, a cancel) found it by its id on every shard: a read over every worker, a
cancel an UPDATE over every shard, so a two-phase commit.

- ``run_homes``: one row per run, its id, its conversation and its owner, written with the run
  in the same statement (Citus commits a write of a coordinator's plain table and one worker's
  shard in one phase) and deleted with it. On Citus a plain table on the coordinator
  (service/store/postgres/placement.py): a replica that does not know a run's conversation reads
  it there, a statement that needs no worker, then names it in the run's statements, which go
  to that one worker. Plain PostgreSQL never writes nor reads it (its statements find a run by
  its id in one index already).

Expand only: a new table the previous release never uses. A run it makes during a rolling
upgrade has no row here, and is found by its id alone, as before. The downgrade drops the table:
what it loses is where each run is (found by its id alone again).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Runs while the previous release serves: follow "Writing a migration" in deploy/README.md.
# Frozen once released: the SQL it runs is written here, never imported (migrations/__init__.py).
def upgrade() -> None:
    op.create_table(
        "run_homes",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
    )
    # A conversation's runs go with it (deleted, purged): their homes too.
    op.create_index("run_homes_conversation", "run_homes", ["conversation_id"])


def downgrade() -> None:
    op.drop_table("run_homes")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: where each run is (found by its id alone again)."""
    return live.nonzero({"run_homes": live.count(connection, "run_homes", "true")})
