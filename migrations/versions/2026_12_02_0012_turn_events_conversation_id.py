"""turn_events.conversation_id: the distribution column of the events on Citus

On Citus (deploy/SCALE-OUT.md) a run's events live with their conversation, distributed by
its id, so each event row names it. Expand-style: the column is nullable and has no default,
so adding it rewrites nothing; ``turnstore db distribute`` fills it in rows written without
it and then makes it part of the events' primary key. Every INSERT into turn_events must
write it from now on (on Citus a row without it is refused).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("turn_events", sa.Column("conversation_id", sa.Uuid))


def downgrade() -> None:
    op.drop_column("turn_events", "conversation_id")


def losses(connection: Connection) -> dict[str, int]:
    """The events' conversation ids, which the events' own run names again: nothing a
    downgrade takes that the release before it reads."""
    return live.nonzero({})
