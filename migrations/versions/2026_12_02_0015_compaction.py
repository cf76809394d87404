"""turns: the compacted context a turn ran on (compaction, CONTEXT_STRATEGY=compact)

- ``compacted``: the provider's compacted output the turn was sent on instead of the earlier
  turns (the user messages it kept, then one opaque ``compaction`` item), replayed byte for
  byte by every later turn's window, which starts at it (json; NULL for a turn that did not
  compact); ``sealed_compacted`` is its twin under encryption at rest.

Expand only: nullable columns without defaults, no rewrite, and the release before this one
never reads them (its windows start at the turn's ``context_from`` as always, and so do the
compacting turn's own replay items).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("compacted", postgresql.JSON), ("sealed_compacted", sa.LargeBinary))


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("turns", sa.Column(name, kind))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("turns", name)


def losses(connection: Connection) -> dict[str, int]:
    """Compacted contexts: after the downgrade, later turns' windows send the compacting
    turn's own items without the compaction before them (the earlier turns stay out)."""
    return live.nonzero(
        {
            f"turns.{name}": live.count(connection, "turns", f"{name} IS NOT NULL")
            for name, _ in COLUMNS
        }
    )
