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

from migrations import commit_function, live

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The function (and what 0018 makes of it) is written in migrations/commit_function.py.
FUNCTION = commit_function.definition(counts_revision=False)
SIGNATURE = commit_function.SIGNATURE


def upgrade() -> None:
    op.execute(FUNCTION)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION turnstore_commit({SIGNATURE})")


def losses(connection: Connection) -> dict[str, int]:
    """A function: no data."""
    return live.nonzero({})
