"""tool calls: each call of a turn as the model proposed it and how the gate ruled

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A JSON array per turn (name, arguments, accepted, status, duration): kept with its turn,
    # so appending a turn stays one row and deleting a conversation removes it too.
    op.add_column("turns", sa.Column("tool_calls", postgresql.JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "tool_calls")


def losses(connection: Connection) -> dict[str, int]:
    """The record of each turn's tool calls."""
    return nonzero({"turns.tool_calls": count(connection, "turns", "tool_calls IS NOT NULL")})
