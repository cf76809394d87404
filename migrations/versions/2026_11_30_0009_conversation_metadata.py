"""the OpenAI surface: conversation metadata, and conversations without turns yet

``POST /v1/conversations`` makes a conversation before its first turn: revision 0. Its
``metadata`` (at most 16 string pairs) is not part of the history: changing it is no commit.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("metadata", sa.JSON))
    op.drop_constraint("conversations_revision_positive", "conversations", type_="check")
    op.create_check_constraint(
        "conversations_revision_not_negative", "conversations", "revision >= 0"
    )


def downgrade() -> None:
    # Conversations without a turn cannot exist before this revision.
    op.execute("DELETE FROM conversations WHERE revision = 0")
    op.drop_constraint("conversations_revision_not_negative", "conversations", type_="check")
    op.create_check_constraint("conversations_revision_positive", "conversations", "revision >= 1")
    op.drop_column("conversations", "metadata")


def losses(connection: Connection) -> dict[str, int]:
    """Conversations without a turn yet (made by `POST /v1/conversations`), and every
    conversation's metadata."""
    return nonzero(
        {
            "conversations": count(connection, "conversations", "revision = 0"),
            "conversations.metadata": count(connection, "conversations", "metadata IS NOT NULL"),
        }
    )
