"""context window: the committed window start, and per turn what the model saw

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # The first turn the next request may carry; it only advances, in a turn's commit.
    op.add_column(
        "conversations",
        sa.Column("context_start", sa.Integer, nullable=False, server_default="1"),
    )
    # The window the model saw for this turn: turns context_from .. seq - 1, plus the prompt.
    op.add_column("turns", sa.Column("context_from", sa.Integer, nullable=True))
    op.add_column("turns", sa.Column("prompt_version", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "prompt_version")
    op.drop_column("turns", "context_from")
    op.drop_column("conversations", "context_start")


def losses(connection: Connection) -> dict[str, int]:
    """The committed window starts (the window could move back) and what each turn's model
    saw."""
    return nonzero(
        {
            "conversations.context_start": count(connection, "conversations", "context_start > 1"),
            "turns.context_from/prompt_version": count(
                connection, "turns", "context_from IS NOT NULL OR prompt_version IS NOT NULL"
            ),
        }
    )
