"""turnstore_secrets: the deployment's own random keys; owner_tombstones: shredded owners, by a
keyed digest

- ``turnstore_secrets``: one row per purpose, each 32 random bytes made here, once per
  deployment, read by every replica: ``ids`` keys the ids turnstore mints (opaque: they
  reveal neither a conversation nor a revision), ``owners`` keys the digest an owner is named
  by in a tombstone (never in clear). On Citus a reference table (a commit reads it on the
  worker of its conversation).
- ``owner_tombstones``: one row per shredded owner (``turnstore owners shred``), named by
  ``sha256(owners secret || owner)``; a commit, a new conversation or a fork of an owner
  named here writes nothing. On Citus a reference table.

Expand only: two new tables the release before this one never reads. The downgrade drops
them: what it loses is the deployment's keys (ids minted under them name nothing afterwards)
and the tombstones (a shredded owner's name could write again).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import os
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PURPOSES = ("ids", "owners")


def upgrade() -> None:
    op.create_table(
        "turnstore_secrets",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("secret", sa.LargeBinary, nullable=False),
    )
    secrets = sa.table("turnstore_secrets", sa.column("name"), sa.column("secret"))
    op.bulk_insert(secrets, [{"name": name, "secret": os.urandom(32)} for name in PURPOSES])
    op.create_table(
        "owner_tombstones",
        sa.Column("digest", sa.LargeBinary, primary_key=True),
        sa.Column("shredded_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("owner_tombstones")
    op.drop_table("turnstore_secrets")


def losses(connection: Connection) -> dict[str, int]:
    """The tombstones of shredded owners, and the deployment's keys once anything was
    minted under them (with a turn stored, an id shown for it then names nothing)."""
    minted = live.count(connection, "turns") > 0
    return live.nonzero(
        {
            "turnstore_secrets": live.count(connection, "turnstore_secrets") if minted else 0,
            "owner_tombstones": live.count(connection, "owner_tombstones"),
        }
    )
