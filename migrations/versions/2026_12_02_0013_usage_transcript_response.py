"""turns: usage, a transcript of every message, and what the OpenAI surface records of a response

- ``usage``: the provider's usage of the turn's calls, added up (json; not sealed: token
  counts say nothing a user said);
- ``transcript``: the turn's messages of every role as people read them
  (``[[role, text], ...]``; NULL for a plain user/assistant pair, which ``user_message`` and
  ``assistant_message`` still hold, and which a release before this one reads);
- ``response``: what a ``/v1`` response echoes of its request and when it was created (NULL
  for ``/api/v1`` turns).

The last two hold what users said, so each has its ``sealed_`` twin (encryption at rest).
Expand only: nullable columns without defaults, no rewrite, and the release before this one
never reads them.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("usage", postgresql.JSON),
    ("transcript", postgresql.JSON),
    ("sealed_transcript", sa.LargeBinary),
    ("response", postgresql.JSON),
    ("sealed_response", sa.LargeBinary),
)


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("turns", sa.Column(name, kind))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("turns", name)


def losses(connection: Connection) -> dict[str, int]:
    """Per-turn usage, transcripts of messages of other roles than a user's and an
    assistant's, and what /v1 responses echoed (the messages themselves stay in the replay
    items and in user_message / assistant_message)."""
    return live.nonzero(
        {
            f"turns.{name}": live.count(connection, "turns", f"{name} IS NOT NULL")
            for name, _ in COLUMNS
        }
    )
