"""Alembic, driven from code: `turnstore db ...`, the embedded default and the tests."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TextIO

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)


def alembic_config(database_url: str | None = None, *, stdout: TextIO | None = None) -> Config:
    config = Config(stdout=stdout) if stdout is not None else Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    # Passed as an attribute, not an ini option, so a '%' in the URL needs no escaping.
    config.attributes["database_url"] = database_url
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> frozenset[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> str:
    out = io.StringIO()
    command.current(alembic_config(database_url, stdout=out))
    return out.getvalue().strip()
