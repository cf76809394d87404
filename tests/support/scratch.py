"""Scratch migrations for the runner's tests: a version location of the test's own, one
migration on top of this release's head (whatever it is), so the runner's lock handling is
exercised even while the release itself brings no migration."""

from __future__ import annotations

import textwrap
from pathlib import Path

from service.platform import migrate

REVISION = "9001"
ADD_COLUMN = 'op.execute("ALTER TABLE turns ADD COLUMN scratch text")'


def scratch_migration(directory: Path, body: str = ADD_COLUMN, *, revision: str = REVISION) -> str:
    """Write a migration running ``body`` (Python, ``op`` and ``live`` in scope) on top of
    the head into ``directory``; the directory, for ``version_locations``."""
    directory.mkdir(parents=True, exist_ok=True)
    head = migrate.head_revision()
    code = [
        '"""scratch migration of the tests"""',
        "from alembic import op",
        "from migrations import live",
        f"revision = {revision!r}",
        f"down_revision = {head!r}",
        "branch_labels = None",
        "depends_on = None",
        "def upgrade() -> None:",
        textwrap.indent(body, "    "),
        "def downgrade() -> None:",
        "    pass",
        "def losses(connection) -> dict[str, int]:",
        "    return {}",
    ]
    (directory / f"{revision}_scratch.py").write_text("\n".join(code) + "\n")
    return str(directory)
