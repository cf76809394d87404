"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live
${imports if imports else ""}
revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}


# Runs while the previous release serves: follow "Writing a migration" in deploy/README.md.
# Frozen once released: the SQL it runs is written here, never imported (migrations/__init__.py).
def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}


def losses(connection: Connection) -> dict[str, int]:
    """What downgrade() destroys on the database as it is: rows per table, values of dropped
    columns as "table.column" (see migrations/revisions.py), e.g.
    ``{"turns": live.count(connection, "turns", "x IS NOT NULL")}``. Say why when nothing."""
    return live.nonzero({})
