"""Alembic, driven from code: `turnstore db ...`, the embedded default and the tests.

Two chains share one environment (migrations/env.py): the data's (migrations/versions,
version table ``alembic_version``) and the keyring's (migrations/keyring, ``keyring_version``),
which lives in the data's database unless KEYRING_DATABASE_URL names another.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

import migrations
from migrations import revisions
from service.platform.settings import Settings

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)
KEYRING_VERSIONS = str(Path(migrations.__file__).parent / "keyring")
DATA_VERSIONS = str(Path(migrations.__file__).parent / "versions")
LOCK_TIMEOUT_S: float = Settings.migration_lock_timeout_s  # its default


class Refused(RuntimeError):
    """A `turnstore db` command that cannot do what it was asked here (the placement on Citus,
    service/store/postgres/placement.py); the message says why, in one line, and the command
    line prints it as it is."""


def alembic_config(
    database_url: str | None = None,
    *,
    stdout: TextIO | None = None,
    keyring: bool = False,
    lock_timeout_s: float | None = None,
    version_locations: Sequence[str] = (),
) -> Config:
    """``version_locations``: more migrations beside the data's (the tests' scratch ones)."""
    config = Config(stdout=stdout) if stdout is not None else Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if keyring or version_locations:
        config.set_main_option("path_separator", "os")
        where = [KEYRING_VERSIONS] if keyring else [DATA_VERSIONS, *version_locations]
        config.set_main_option("version_locations", os.pathsep.join(where))
    if keyring:
        config.attributes["version_table"] = "keyring_version"
    # Passed as an attribute, not an ini option, so a '%' in the URL needs no escaping.
    config.attributes["database_url"] = database_url
    config.attributes["lock_timeout_s"] = lock_timeout_s
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> frozenset[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def upgrade(
    database_url: str,
    revision: str = "head",
    *,
    keyring_url: str | None = None,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    version_locations: Sequence[str] = (),
) -> None:
    """The data's schema to ``revision``, and the keyring's to its head (in ``keyring_url``,
    or beside the data). Each migration in its own transaction, its lock waits bounded by
    ``lock_timeout_s`` and retried (migrations/runner.py)."""
    data = alembic_config(
        database_url, lock_timeout_s=lock_timeout_s, version_locations=version_locations
    )
    command.upgrade(data, revision)
    keyring = alembic_config(
        keyring_url or database_url, keyring=True, lock_timeout_s=lock_timeout_s
    )
    command.upgrade(keyring, "head")


def downgrade(
    database_url: str,
    revision: str,
    *,
    allow_data_loss: bool = False,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    stdout: TextIO | None = None,
) -> None:
    """Back to ``revision``. What that would delete is written to ``stdout`` first; when it
    is anything, ``revisions.DataLoss`` is raised unless ``allow_data_loss``."""
    config = alembic_config(database_url, lock_timeout_s=lock_timeout_s)
    revisions.check_downgrade(config, database_url, revision, allow_data_loss, stdout)
    command.downgrade(config, revision)


def current(database_url: str, keyring_url: str | None = None) -> str:
    """The data schema's revision and the keyring's, one line each."""
    return revisions.describe(
        alembic_config(), alembic_config(keyring=True), database_url, keyring_url
    )


def status(database_url: str, keyring_url: str | None = None) -> dict[str, revisions.Revision]:
    """The data schema's and the keyring's revisions against this release's heads."""
    return revisions.status(
        alembic_config(), alembic_config(keyring=True), database_url, keyring_url
    )
