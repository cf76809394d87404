"""the keyring: each owner's data key, wrapped by a master key

Its own schema (version table ``keyring_version``) so that it can live in a database of its
own (KEYRING_DATABASE_URL) whose backups are kept apart from the data's: destroying a data
key there (``turnstore owners shred``) makes that owner's rows in every backup of the data
unreadable. ``turnstore db downgrade`` never touches it: dropping it would destroy every key.

Revision ID: k001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "k001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "owner_keys",
        sa.Column("owner", sa.Text, primary_key=True),
        sa.Column("master_key_id", sa.Text, nullable=False),  # which master key wraps it
        sa.Column("wrapped", sa.LargeBinary, nullable=False),  # nonce + AES-GCM(data key)
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("owner_keys")
