"""owners, API keys, idempotency keys, and what retention needs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Conversations from before owners belong to the single owner of AUTH_MODE=none.
    op.add_column(
        "conversations",
        sa.Column("owner", sa.Text, nullable=False, server_default="anonymous"),
    )
    # Listing a caller's conversations newest first, with a (created_at, id) cursor.
    op.create_index(
        "conversations_owner_created",
        "conversations",
        ["owner", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    # Retention purges by idleness.
    op.create_index("conversations_updated", "conversations", ["updated_at"])
    op.create_table(
        "api_keys",
        sa.Column("key_hash", sa.Text, primary_key=True),  # sha256 of the key; never the key
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("request_hash", sa.Text, nullable=False),
        # 'running' while the first request is in flight (a lease until expires_at), 'done'
        # once its turn committed, in the same transaction as the turn.
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("response", postgresql.JSON, nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "key"),
        sa.CheckConstraint("state IN ('running', 'done')", name="idempotency_keys_state"),
    )
    op.create_index("idempotency_keys_expires", "idempotency_keys", ["expires_at"])


def downgrade() -> None:
    op.drop_index("idempotency_keys_expires", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_table("api_keys")
    op.drop_index("conversations_updated", table_name="conversations")
    op.drop_index("conversations_owner_created", table_name="conversations")
    op.drop_column("conversations", "owner")


def losses(connection: Connection) -> dict[str, int]:
    """Every API key and Idempotency-Key record, and who owns each conversation (all become
    the one anonymous owner's)."""
    return nonzero(
        {
            "api_keys": count(connection, "api_keys"),
            "idempotency_keys": count(connection, "idempotency_keys"),
            "conversations.owner": count(connection, "conversations", "owner <> 'anonymous'"),
        }
    )
