"""durable turns: a run per streamed or background turn, and the events its client saw

``turn_runs`` holds a turn's status while it runs and for TURN_EVENTS_TTL_S after it ended
(``expires_at``); ``heartbeat_until`` is renewed by the replica running it, so any replica can
tell a run whose replica vanished. ``turn_events`` holds what the client saw (text deltas,
tool-call statuses, the terminal event), never replay items: one row per batch the replica
logged, ``seq`` the number of its last event, ``events`` a JSON array of ``[seq, name, data]``
(a row per event cost ten times the WAL of a row per batch). A committed
turn records its run's id in ``turns.turn_id`` (one query from a run to its turn).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "turn_runs",
        sa.Column("id", sa.Uuid, primary_key=True),
        # No foreign key: a new conversation's row exists only once its first turn commits.
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("background", sa.Boolean, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("revision", sa.Integer, nullable=True),
        sa.Column("error_code", sa.Text, nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("watched", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("last_event", sa.Integer, nullable=False, server_default="0"),
        sa.Column("heartbeat_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'in_progress', 'completed', 'incomplete', 'failed', 'cancelled')",
            name="turn_runs_status",
        ),
    )
    op.create_index("turn_runs_conversation", "turn_runs", ["conversation_id"])
    op.create_index("turn_runs_expires", "turn_runs", ["expires_at"])
    op.create_table(
        "turn_events",
        sa.Column("turn_id", sa.Uuid, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("events", postgresql.JSON, nullable=False),
        sa.PrimaryKeyConstraint("turn_id", "seq"),
        sa.ForeignKeyConstraint(["turn_id"], ["turn_runs.id"], ondelete="CASCADE"),
    )
    op.add_column("turns", sa.Column("turn_id", sa.Uuid, nullable=True))
    op.add_column("idempotency_keys", sa.Column("turn_id", sa.Uuid, nullable=True))


def downgrade() -> None:
    op.drop_column("idempotency_keys", "turn_id")
    op.drop_column("turns", "turn_id")
    op.drop_table("turn_events")
    op.drop_index("turn_runs_expires", table_name="turn_runs")
    op.drop_index("turn_runs_conversation", table_name="turn_runs")
    op.drop_table("turn_runs")


def losses(connection: Connection) -> dict[str, int]:
    """Every run and every event of durable turns (their status and replay for clients)."""
    return nonzero(
        {
            "turn_runs": count(connection, "turn_runs"),
            "turn_events": count(connection, "turn_events"),
        }
    )
