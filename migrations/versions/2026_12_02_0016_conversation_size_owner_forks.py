"""conversations: how much text and items a conversation holds (MAX_CONVERSATION_BYTES);
owner_forks: each owner's forks of the last minute (OWNER_MAX_FORKS_PER_MINUTE)

- ``stored_bytes``: the bytes of text and items the conversation's turns store, as
  service/core/sizes.py counts them, written by every commit with the new total (bigint; NULL:
  not counted yet, for conversations written before this migration, forked or with an item
  removed: the next turn counts it from the history it holds, an item append reads it once).
- ``owner_forks``: one row per fork (owner, the fork's conversation, when), counted by the
  transaction that makes a fork and pruned by it past a minute; on Citus distributed by owner.

Expand only: a new table and a nullable column without default, no rewrite, and the release
before this one never reads them. Its commits leave the column as it was, so a count can lag
behind a previous-release replica's turns: the limit is then checked on the smaller count
until this release's next turn counts the history again (documented in deploy/README.md).
Forks made by the previous release are not counted.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("stored_bytes", sa.BigInteger()))
    op.create_table(
        "owner_forks",
        sa.Column("owner", sa.Text, nullable=False),
        sa.Column("conversation_id", sa.Uuid, nullable=False),
        sa.Column("made_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "conversation_id"),
    )


def downgrade() -> None:
    op.drop_table("owner_forks")
    op.drop_column("conversations", "stored_bytes")


def losses(connection: Connection) -> dict[str, int]:
    """Nothing a client wrote: the size counts are made again from the turns after an
    upgrade, and the forks of the last minute stop counting against their owners' limit."""
    return live.nonzero({"owner_forks": live.count(connection, "owner_forks", "true")})
