"""Alembic, driven from code: `turnstore db ...`, the embedded default and the tests.

Two chains share one environment (migrations/env.py): the data's (migrations/versions,
version table ``alembic_version``) and the keyring's (migrations/keyring, ``keyring_version``),
which lives in the data's database unless KEYRING_DATABASE_URL names another.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TextIO

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)
KEYRING_VERSIONS = str(Path(migrations.__file__).parent / "keyring")


def alembic_config(
    database_url: str | None = None, *, stdout: TextIO | None = None, keyring: bool = False
) -> Config:
    config = Config(stdout=stdout) if stdout is not None else Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if keyring:
        config.set_main_option("path_separator", "os")
        config.set_main_option("version_locations", KEYRING_VERSIONS)
        config.attributes["version_table"] = "keyring_version"
    # Passed as an attribute, not an ini option, so a '%' in the URL needs no escaping.
    config.attributes["database_url"] = database_url
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> frozenset[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def upgrade(database_url: str, revision: str = "head", *, keyring_url: str | None = None) -> None:
    """The data's schema to ``revision``, and the keyring's to its head (in ``keyring_url``,
    or beside the data)."""
    command.upgrade(alembic_config(database_url), revision)
    command.upgrade(alembic_config(keyring_url or database_url, keyring=True), "head")


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current(database_url: str) -> str:
    out = io.StringIO()
    command.current(alembic_config(database_url, stdout=out))
    return out.getvalue().strip()
