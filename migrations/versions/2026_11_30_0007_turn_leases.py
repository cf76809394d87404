"""turn leases: which turn may call the provider for a conversation now

``lease_holder`` is the running turn's id, valid until ``lease_expires_at`` (renewed while the
turn runs). ``lease_wanted`` says a turn is queued for the lease: only then does the holder's
release notify (a NOTIFY costs every commit a global lock, so it is not sent for nothing).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("lease_holder", sa.Uuid, nullable=True))
    op.add_column(
        "conversations", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column(
        "conversations",
        sa.Column("lease_wanted", sa.Boolean, nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("conversations", "lease_wanted")
    op.drop_column("conversations", "lease_expires_at")
    op.drop_column("conversations", "lease_holder")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing stored: a lease says which turn may run now. A turn running while this is
    undone loses its lease (another turn of its conversation may start; the revision check
    still stops one of them at commit)."""
    return {}
