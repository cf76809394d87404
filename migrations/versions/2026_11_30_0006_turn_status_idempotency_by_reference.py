"""a turn's reply status; an Idempotency-Key names its commit instead of copying its answer

A committed Idempotency-Key record now points at the turn it committed (conversation and
revision) and is deleted with that conversation; a retry rebuilds its answer from the turn.
So no copy of a reply outlives its conversation, and nothing predicts a revision.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("status", sa.Text, nullable=False, server_default="completed"))
    op.add_column("turns", sa.Column("incomplete_reason", sa.Text, nullable=True))
    op.add_column("idempotency_keys", sa.Column("conversation_id", sa.Uuid, nullable=True))
    op.add_column("idempotency_keys", sa.Column("revision", sa.Integer, nullable=True))
    # Stored answers become references; those of conversations deleted meanwhile go.
    op.execute(
        """
        UPDATE idempotency_keys k
           SET conversation_id = (k.response ->> 'conversation_id')::uuid,
               revision = (k.response ->> 'revision')::int
         WHERE k.state = 'done'
        """
    )
    op.execute(
        """
        DELETE FROM idempotency_keys k
         WHERE k.state = 'done' AND NOT EXISTS
               (SELECT 1 FROM conversations c WHERE c.id = k.conversation_id)
        """
    )
    op.execute("UPDATE idempotency_keys SET response = NULL")
    op.create_foreign_key(
        "idempotency_keys_conversation",
        "idempotency_keys",
        "conversations",
        ["conversation_id"],
        ["id"],
        ondelete="CASCADE",
    )
    op.create_index("idempotency_keys_conversation", "idempotency_keys", ["conversation_id"])


def downgrade() -> None:
    op.drop_index("idempotency_keys_conversation", table_name="idempotency_keys")
    op.drop_constraint("idempotency_keys_conversation", "idempotency_keys", type_="foreignkey")
    # The earlier schema replays a stored answer; references cannot become one: forget them.
    op.execute("DELETE FROM idempotency_keys WHERE state = 'done'")
    op.drop_column("idempotency_keys", "revision")
    op.drop_column("idempotency_keys", "conversation_id")
    op.drop_column("turns", "incomplete_reason")
    op.drop_column("turns", "status")


def losses(connection: Connection) -> dict[str, int]:
    """Every completed Idempotency-Key record (a retry would run its turn again), and which
    turns were incomplete."""
    return nonzero(
        {
            "idempotency_keys": count(connection, "idempotency_keys", "state = 'done'"),
            "turns.status": count(connection, "turns", "status <> 'completed'"),
        }
    )
