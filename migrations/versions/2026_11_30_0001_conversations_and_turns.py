"""conversations and their append-only turns

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("revision", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("revision >= 1", name="conversations_revision_positive"),
    )
    op.create_table(
        "turns",
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("user_message", sa.Text, nullable=False),
        sa.Column("assistant_message", sa.Text, nullable=False),
        # json, not jsonb: it keeps the provider's bytes exactly as they were sent.
        sa.Column("replay_items", postgresql.JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", "seq"),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"], ondelete="CASCADE"),
    )


def downgrade() -> None:
    op.drop_table("turns")
    op.drop_table("conversations")


def losses(connection: Connection) -> dict[str, int]:
    """Everything: both tables go."""
    return nonzero(
        {"conversations": count(connection, "conversations"), "turns": count(connection, "turns")}
    )
