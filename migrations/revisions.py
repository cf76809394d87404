"""What the database's schemas are at (`turnstore db current`), and what going back would
delete (`turnstore db downgrade`).

Every data migration declares ``losses(connection) -> dict[str, int]``: what its
``downgrade()`` would destroy if it ran on the database as it is now: rows a table would
lose (keyed by the table) and values a dropped column holds (keyed ``table.column``).
Before a downgrade, the ``losses`` of every migration it undoes are counted and printed, newest
first, in one read-only snapshot; when any is non-zero the downgrade is refused unless the
operator allowed the loss. A later migration's rows may be counted again by an earlier one
that drops their whole table.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from alembic.config import Config
from alembic.script import Script, ScriptDirectory
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from migrations import runner
from service.platform.db import async_url


class DataLoss(RuntimeError):
    """The downgrade would delete data and the operator did not allow it."""


class UnknownRevision(RuntimeError):
    """The database is at a revision this release does not know: a newer release's."""


def _sync(url: str, work: Callable[[Connection], Any]) -> Any:
    """``work`` on a connection of the runner's kind (application_name, lock_timeout)."""

    async def run() -> Any:
        engine = create_async_engine(
            async_url(url),
            poolclass=pool.NullPool,
            connect_args={"server_settings": runner.server_settings(2.0)},
        )
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def versions(connection: Connection, table: str) -> list[str]:
    if not connection.scalar(text("SELECT to_regclass(:t)::text"), {"t": table}):
        return []
    return sorted(connection.scalars(text(f"SELECT version_num FROM {table}")))


def _state(script: ScriptDirectory, found: Sequence[str]) -> str:
    head = script.get_current_head()
    known = {each.revision for each in script.walk_revisions()}
    if not found:
        return f"none (not migrated; this release's head is {head})"
    unknown = [rev for rev in found if rev not in known]
    at = ", ".join(found)
    if unknown:
        return f"{at} (unknown to this release, whose head is {head}: a newer release migrated it)"
    if list(found) == [head]:
        return f"{at} (head)"
    return f"{at} (behind this release's head {head}: run `turnstore db upgrade`)"


def describe(
    data: Config, keyring: Config, database_url: str, keyring_url: str | None = None
) -> str:
    """Two lines: the data schema's revision and the keyring's."""
    found = _sync(database_url, lambda c: versions(c, "alembic_version"))
    where = " (KEYRING_DATABASE_URL)" if keyring_url else ""
    keys = _sync(keyring_url or database_url, lambda c: versions(c, "keyring_version"))
    return (
        f"data schema: {_state(ScriptDirectory.from_config(data), found)}\n"
        f"keyring{where}: {_state(ScriptDirectory.from_config(keyring), keys)}"
    )


@dataclass(frozen=True)
class Revision:
    """Where one schema is (its version table's rows), this release's head, and in words."""

    at: list[str]
    head: str | None
    words: str

    @property
    def ok(self) -> bool:
        return self.at == [self.head]


def status(
    data: Config, keyring: Config, database_url: str, keyring_url: str | None = None
) -> dict[str, Revision]:
    """The data schema's and the keyring's revisions against this release's heads."""
    found = {
        "data schema": (data, _sync(database_url, lambda c: versions(c, "alembic_version"))),
        "keyring": (
            keyring,
            _sync(keyring_url or database_url, lambda c: versions(c, "keyring_version")),
        ),
    }
    revisions = {}
    for name, (config, at) in found.items():
        script = ScriptDirectory.from_config(config)
        revisions[name] = Revision(at, script.get_current_head(), _state(script, at))
    return revisions


def undone(script: ScriptDirectory, current: str | None, target: str) -> list[Script]:
    """The migrations a downgrade from ``current`` to ``target`` undoes, newest first
    (``target``: a revision, ``base``, or ``-N``)."""
    steps: list[Script] = []
    rev = current
    if re.fullmatch(r"-\d+", target):
        for _ in range(int(target[1:])):
            if rev is None:
                raise RuntimeError(f"cannot go {target} from {current or 'base'}")
            steps.append(script.get_revision(rev))
            rev = steps[-1].down_revision  # type: ignore[assignment]
        return steps
    if target != "base":
        try:
            script.get_revision(target)
        except Exception:
            raise RuntimeError(f"no revision {target!r} in this release") from None
    goal = None if target == "base" else script.get_revision(target).revision
    while rev != goal:
        if rev is None:
            raise RuntimeError(f"{target} is not below the database's {current or 'base'}")
        steps.append(script.get_revision(rev))
        rev = steps[-1].down_revision  # type: ignore[assignment]
    return steps


def check_downgrade(
    config: Config,
    database_url: str,
    target: str,
    allow_data_loss: bool,
    stdout: TextIO | None = None,
) -> None:
    """Print what going back to ``target`` deletes; refuse (DataLoss) when that is anything
    and the loss is not allowed."""
    out = stdout or sys.stdout
    script = ScriptDirectory.from_config(config)
    known = {each.revision for each in script.walk_revisions()}

    def count(connection: Connection) -> tuple[list[str], list[tuple[Script, dict[str, int]]]]:
        connection.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
        found = versions(connection, "alembic_version")
        unknown = [rev for rev in found if rev not in known]
        if unknown or len(found) > 1:
            return found, []
        steps = undone(script, found[0] if found else None, target)
        return found, [(step, step.module.losses(connection)) for step in steps]

    found, losses = _sync(database_url, count)
    if [rev for rev in found if rev not in known]:
        raise UnknownRevision(
            f"the schema is at {', '.join(found)}, which this release does not know (its head "
            f"is {script.get_current_head()}): downgrade with the image of the release that "
            "migrated it"
        )
    if not losses:
        out.write(f"nothing to undo: the schema is at {target}\n")
        return
    revision = found[0] if found else "base"
    out.write(
        f"downgrading {revision} -> {target} undoes {len(losses)} migration"
        f"{'s' if len(losses) != 1 else ''}; what each deletes:\n"
    )
    lost = False
    for step, counts in losses:
        counts = {what: n for what, n in counts.items() if n}
        lost = lost or bool(counts)
        said = ", ".join(f"{what} {n}" for what, n in counts.items()) or "nothing"
        out.write(f"  {step.revision} {step.doc.split(':')[0]}: {said}\n")
    out.flush()
    if lost and not allow_data_loss:
        raise DataLoss(
            "refused: this downgrade deletes the data listed above; back it up, then run it "
            "again with --allow-data-loss"
        )
