"""stored responses: what a /v1 response needs to be kept, resumed and deleted like OpenAI's

- ``conversations.expires_at``: a conversation made for a stored response (a ``/v1`` call
  without a conversation) is gone once this passes (STORED_RESPONSE_TTL_DAYS after its last
  turn, moved on by each commit) and purged; NULL for every other conversation;
- ``turns.response_deleted``: ``DELETE /v1/responses/{id}`` happened (the response is unknown
  from then on; the turn and its items stay, as on OpenAI);
- ``turn_runs.base_revision``: the revision a run's turn held its conversation at, so a
  streamed response (named by the revision it makes) finds its run to resume;
- ``turn_runs.response`` (+ ``sealed_response``): what the run's Response echoes of its request
  and when it was created, so any replica renders the same events; ``turn_runs.message_id``:
  the provider's id of the message being streamed, logged with the first events.

Expand only: nullable columns without defaults, no rewrite, no index; the release before this
one never reads them (and filters nothing by ``expires_at``: until a purge it keeps showing a
stored response's conversation past its expiry).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("conversations", "expires_at", sa.DateTime(timezone=True)),
    ("turns", "response_deleted", sa.Boolean),
    ("turn_runs", "base_revision", sa.Integer),
    ("turn_runs", "response", postgresql.JSON),
    ("turn_runs", "sealed_response", sa.LargeBinary),
    ("turn_runs", "message_id", sa.Text),
)


def upgrade() -> None:
    # Three of the service's tables: each column in a transaction of its own (a turn takes
    # the locks of conversations and turns in either order; holding one while waiting for the
    # other deadlocked with the previous release's lease statement in tests/test_rolling_upgrade).
    dialect = op.get_bind().dialect
    for table, name, kind in COLUMNS:
        live.add_column_alone(op, table, name, sa.types.to_instance(kind).compile(dialect=dialect))


def downgrade() -> None:
    for table, name, _ in reversed(COLUMNS):
        op.drop_column(table, name)


def losses(connection: Connection) -> dict[str, int]:
    """The expiry of stored responses' conversations (they would never expire), deletions of
    responses (deleted ones would be found again), and what runs record for their /v1
    streams (a resumed stream would lose its message id and echo)."""
    return live.nonzero(
        {
            f"{table}.{name}": live.count(connection, table, f"{name} IS NOT NULL")
            for table, name, _ in COLUMNS
        }
    )
