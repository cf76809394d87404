"""history rewrites: the revision at which a conversation's earlier history last changed

Removing the latest item (``DELETE /v1/conversations/{id}/items/{item_id}``, the Agents SDK's
``pop_item``) rewrites the last turn. Readers that keep history (the replica-local cache)
compare ``rewritten_at`` with the revision they hold and read afresh when it is newer.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "conversations",
        sa.Column("rewritten_at", sa.Integer, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("conversations", "rewritten_at")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing stored but a marker for replicas' history caches: the code before it never
    rewrites history."""
    return {}
