"""Helpers for migrations that run while replicas serve (the rules: deploy/README.md,
"Writing a migration").

Inside a migration (``op`` is Alembic's):

- ``create_index_concurrently(op, "turns_x", "turns", "x")``: outside the migration's
  transaction, without blocking writes; a leftover invalid index of an earlier, interrupted
  attempt is dropped first, so the migration can be retried.
- ``add_foreign_key_not_valid`` / ``add_check_not_valid`` then ``validate``: the constraint is
  enforced for new rows at once (a brief lock), and existing rows are checked later under a
  lock that lets reads and writes go on.
- ``add_column_alone(op, "turns", "x", "integer")``: a column in a transaction of its own, for
  a migration that changes more than one of the service's tables (see why there).
- ``backfill(op, "UPDATE turns SET x = ... WHERE ctid = ANY(...)")``: in batches, each its own
  transaction, outside the schema change.
- ``count(connection, "turns", "x IS NOT NULL")``: for a migration's ``losses``.
- ``distributed(op.get_bind())``: whether this is a Citus coordinator whose conversations are
  distributed already (a migration then places what it adds itself, as `db distribute` would).

Every migration declares ``losses(connection) -> dict[str, int]``: what its downgrade
would destroy on the database as it is now, counted per table (rows deleted) or per
``table.column`` (values of a dropped column), empty when nothing (migrations/revisions.py).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

BATCH = 5000


def distributed(bind: Connection) -> bool:
    """Whether this is a Citus coordinator whose conversations are distributed already."""
    if not bind.scalar(sa.text("SELECT to_regclass('pg_dist_partition') IS NOT NULL")):
        return False
    return bool(
        bind.scalar(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM pg_dist_partition"
                " WHERE logicalrelid = to_regclass('conversations'))"
            )
        )
    )


def count(connection: Connection, table: str, where: str = "TRUE") -> int:
    return int(connection.scalar(sa.text(f"SELECT count(*) FROM {table} WHERE {where}")) or 0)


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {what: n for what, n in counts.items() if n}


def create_index_concurrently(
    op: Any, name: str, table: str, columns: str, *, unique: bool = False, where: str = ""
) -> None:
    """``CREATE INDEX CONCURRENTLY``: no lock that stops writes, so it runs outside the
    migration's transaction (Alembic's autocommit block). ``columns`` as SQL."""
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        valid = bind.scalar(
            sa.text(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = :name AND c.relnamespace = current_schema()::regnamespace"
            ),
            {"name": name},
        )
        if valid:
            return
        if valid is not None:  # an interrupted attempt left it invalid: build it again
            bind.execute(sa.text(f"DROP INDEX CONCURRENTLY IF EXISTS {name}"))
        kind = "UNIQUE INDEX" if unique else "INDEX"
        predicate = f" WHERE {where}" if where else ""
        bind.execute(
            sa.text(f"CREATE {kind} CONCURRENTLY {name} ON {table} ({columns}){predicate}")
        )


def drop_index_concurrently(op: Any, name: str) -> None:
    with op.get_context().autocommit_block():
        op.get_bind().execute(sa.text(f"DROP INDEX CONCURRENTLY IF EXISTS {name}"))


def add_column_alone(op: Any, table: str, column: str, sql_type: str) -> None:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` in a transaction of its own, for a migration
    that adds columns to more than one of the service's tables: it then holds one table's lock
    at a time. The service takes those locks in both orders (a cached lease statement locks
    ``turns`` before ``conversations``, the commit function the other way), so a migration
    holding one while it waits for the other can deadlock with a turn. Idempotent: a
    migration retried after a lock wait ran out goes on where it stopped."""
    with op.get_context().autocommit_block():
        op.get_bind().execute(
            sa.text(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {sql_type}")
        )


def add_foreign_key_not_valid(
    op: Any, name: str, table: str, columns: str, target: str, on_delete: str = ""
) -> None:
    """Checked for new rows at once; ``validate`` checks the existing ones later. Locks
    ``table`` and ``target`` (SHARE ROW EXCLUSIVE, briefly): name them in the service's
    order (conversations before turns) within the migration."""
    action = f" ON DELETE {on_delete}" if on_delete else ""
    op.execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({columns}) "
        f"REFERENCES {target}{action} NOT VALID"
    )


def add_check_not_valid(op: Any, name: str, table: str, condition: str) -> None:
    op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")


def validate(op: Any, table: str, name: str) -> None:
    """SHARE UPDATE EXCLUSIVE while it scans: reads and writes of ``table`` go on. Its own
    transaction, so the scan holds nothing else."""
    with op.get_context().autocommit_block():
        op.get_bind().execute(sa.text(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}"))


def backfill(op: Any, statement: str, batch: int = BATCH) -> int:
    """Run ``statement`` until it changes no row, each run its own short transaction outside
    the migration's (row locks on at most ``batch`` rows at a time). It must bind
    ``:batch``, change at most that many rows, and leave the rows it changed out of its next
    run, e.g. ``UPDATE t SET x = ... WHERE id IN (SELECT id FROM t WHERE x IS NULL LIMIT
    :batch)`` (not SKIP LOCKED: it would stop early at rows a turn holds). A batch that
    waits out the lock timeout on a row a turn holds fails the migration, which is retried
    and goes on with the rows left."""
    total = 0
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        while changed := bind.execute(sa.text(statement), {"batch": batch}).rowcount:
            total += changed
    return total
