"""idempotency_receipts: a keyed write's receipt beside its conversation (issue 44)

On Citus an Idempotency-Key (``idempotency_keys``) is the coordinator's and a conversation a
worker's: a write that completes a key commits the two in one phase (the worker first), so a
crash of the coordinator after the worker's commit, or a lost acknowledgement of it, left the
key running (or freed) with the write kept, and a retry wrote again.

- ``idempotency_receipts``: one row per keyed write, written in the write's own transaction on
  its conversation's worker (distributed by ``conversation_id`` with ``conversations`` by
  ``turnstore db distribute``): the attempt's claim, its owner and key, the revision it left
  (NULL: a deletion) and when it expires (with its key's TTL). A retry that finds a claim's
  outcome in doubt reads it there (service/store/postgres/receipts.py). Plain PostgreSQL never
  writes nor reads it (its write and its key commit in one transaction).
- ``idempotency_keys.writing``: the conversation a claim will write (on Citus only), so that a
  retry knows which worker holds the receipt.

Expand only: a table and a nullable column the previous release never uses; its claims have no
``writing``, so a retry treats them as before. The downgrade drops both: what it loses is where
a claim in doubt would be settled (a retry runs it again, as before this release).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Runs while the previous release serves: follow "Writing a migration" in deploy/README.md.
# Frozen once released: the SQL it runs is written here, never imported (migrations/__init__.py).
def upgrade() -> None:
    op.create_table(
        "idempotency_receipts",
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("claim_id", sa.Uuid, nullable=False),
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("revision", sa.Integer, nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", "claim_id"),
    )
    op.create_index("idempotency_receipts_expires", "idempotency_receipts", ["expires_at"])
    live.add_column_alone(op, "idempotency_keys", "writing", "uuid")


def downgrade() -> None:
    op.drop_column("idempotency_keys", "writing")
    op.drop_table("idempotency_receipts")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: the receipts of keyed writes (a claim in doubt is run again)."""
    return live.nonzero(
        {"idempotency_receipts": live.count(connection, "idempotency_receipts", "true")}
    )
