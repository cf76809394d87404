"""record which provider, endpoint and model produced each turn's replay items

Encrypted reasoning only decrypts for the provider that sealed it, so the turn service must
know where every turn's items came from. Additive and nullable: code of the previous release
keeps working against this schema (expand/contract).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("provider", sa.Text, nullable=True))
    op.add_column("turns", sa.Column("endpoint", sa.Text, nullable=True))
    op.add_column("turns", sa.Column("model", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "model")
    op.drop_column("turns", "endpoint")
    op.drop_column("turns", "provider")


def losses(connection: Connection) -> dict[str, int]:
    """Which provider, endpoint and model produced each turn."""
    return nonzero(
        {
            "turns.provider/endpoint/model": count(
                connection,
                "turns",
                "provider IS NOT NULL OR endpoint IS NOT NULL OR model IS NOT NULL",
            )
        }
    )
