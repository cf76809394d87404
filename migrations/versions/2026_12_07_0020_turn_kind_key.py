"""turns.kind and turns.key_fingerprint: each turn records its provider's kind and which key
it was called with (0021's turnstore_commit_v3 writes them)

A turn's origin was its provider's name, endpoint and model. The contract's origin also names
the provider's kind (``openai``, ``azure``, ``anthropic``, ``fake``...) and a fingerprint of
the key it was called with (the start of the key's SHA-256: never the key), so that an
operator or an export tells which account made a turn's replay items. Neither tells one
origin from another (core/model.py's ``Origin``): a rotated key opens what the old one was
given.

- ``turns.kind``, ``turns.key_fingerprint``: nullable text; NULL on every turn written before
  (and by the previous release, which goes on calling ``turnstore_commit()``, and images built
  between 0019 and this, which call ``turnstore_commit_v2()``). ``turnstore_commit_v3()``
  (0021) writes them.

Expand only: two nullable columns without defaults, each in a transaction of its own. The
downgrade drops them: it loses the kinds and fingerprints recorded.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy.engine import Connection

from migrations import live

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("turns", "kind", "text"), ("turns", "key_fingerprint", "text"))


def upgrade() -> None:
    for table, column, kind in COLUMNS:
        live.add_column_alone(op, table, column, kind)


def downgrade() -> None:
    for table, column, _ in reversed(COLUMNS):
        op.drop_column(table, column)


def losses(connection: Connection) -> dict[str, int]:
    """The kinds and key fingerprints turns recorded."""
    where = "kind IS NOT NULL OR key_fingerprint IS NOT NULL"
    return live.nonzero({"turns.kind/key_fingerprint": live.count(connection, "turns", where)})
