"""encryption at rest: sealed columns beside the clear ones

With ENCRYPTION_KEYS_FILE set, what a user said or was told is written to the ``sealed_*``
columns (AES-256-GCM under the owner's data key, see service/crypto.py) and the clear column
stays NULL; rows written before stay readable in clear until ``turnstore encrypt-existing``
rewrites them. The owners' data keys live in the keyring, a schema of its own
(migrations/keyring), which may be in another database.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations.live import count, nonzero

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TURN_FIELDS = ("user_message", "assistant_message", "replay_items", "tool_calls")


def upgrade() -> None:
    for name in _TURN_FIELDS:
        op.add_column("turns", sa.Column(f"sealed_{name}", sa.LargeBinary))
    for name in ("user_message", "assistant_message", "replay_items"):
        op.alter_column("turns", name, nullable=True)
    op.add_column("conversations", sa.Column("sealed_metadata", sa.LargeBinary))
    op.add_column("turn_events", sa.Column("sealed_events", sa.LargeBinary))
    op.alter_column("turn_events", "events", nullable=True)


def downgrade() -> None:
    # Dropping the sealed columns would destroy every encrypted turn: refuse while any exists.
    sealed = op.get_bind().scalar(
        sa.text(
            "SELECT EXISTS (SELECT 1 FROM turns WHERE sealed_replay_items IS NOT NULL)"
            " OR EXISTS (SELECT 1 FROM conversations WHERE sealed_metadata IS NOT NULL)"
        )
    )
    if sealed:
        raise RuntimeError("encrypted conversations exist: downgrading would destroy them")
    op.execute("DELETE FROM turn_events WHERE sealed_events IS NOT NULL")  # ephemeral
    op.drop_column("turn_events", "sealed_events")
    op.alter_column("turn_events", "events", nullable=False)
    op.drop_column("conversations", "sealed_metadata")
    for name in ("user_message", "assistant_message", "replay_items"):
        op.alter_column("turns", name, nullable=False)
    for name in _TURN_FIELDS:
        op.drop_column("turns", f"sealed_{name}")


def losses(connection: Connection) -> dict[str, int]:
    """Encrypted turn events (encrypted turns and metadata are never dropped: the downgrade
    refuses while any exists, allowed or not)."""
    return nonzero({"turn_events": count(connection, "turn_events", "sealed_events IS NOT NULL")})
