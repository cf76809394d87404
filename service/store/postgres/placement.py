"""Where each table lives on Citus (deploy/SCALE-OUT.md, "Placement"), and applying it:
``turnstore db distribute``, on the coordinator after ``turnstore db upgrade``.

Every table the migrations make is named here, and tests/system/test_placement.py fails on one that
is not: a migration that adds a table says how it is placed. Citus does not place a new table
by itself (it stays on the coordinator), so ``db distribute`` places what is not placed yet,
checks what is, and changes nothing when all is in place: run it after every ``db upgrade``.
The whole placement is one transaction, under the migrations' advisory lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from migrations.commit_function import (
    COMMIT,
    COMMIT_RECEIPT,
    COMMIT_RUN,
    COMMIT_RUN_RECEIPT,
    COMMIT_V2,
    COMMIT_V3,
    CREATE_RUN,
    END_RUN,
    LOG_RUN,
)
from migrations.runner import LOCK_ID
from service.platform import migrate
from service.platform.db import driver_connect_args
from service.platform.migrate import Refused

DEFAULT_SHARD_COUNT = 64  # per co-location group, fixed: several times the most workers planned


@dataclass(frozen=True)
class ForeignKey:
    """A foreign key kept on Citus (between co-located tables, the key holds the column)."""

    name: str
    columns: tuple[str, ...]
    table: str
    referred: tuple[str, ...]

    def ddl(self, table: str) -> str:
        columns, referred = ", ".join(self.columns), ", ".join(self.referred)
        return (
            f"ALTER TABLE {table} ADD CONSTRAINT {self.name} FOREIGN KEY ({columns})"
            f" REFERENCES {self.table} ({referred}) ON DELETE CASCADE"
        )


@dataclass(frozen=True)
class Distributed:
    """Hash-distributed by ``column``; in the shard group of ``colocate_with`` (a table placed
    before it), or a group of its own ("none")."""

    column: str
    colocate_with: str
    primary_key: tuple[str, ...]  # Citus: it must hold the distribution column
    foreign_keys: tuple[ForeignKey, ...] = ()  # all others are dropped
    fill: str | None = None  # fills ``column`` in rows written before it existed


@dataclass(frozen=True)
class Reference:
    """One shard, copied to every node (written with a two-phase commit on all of them)."""

    foreign_keys: tuple[ForeignKey, ...] = ()


@dataclass(frozen=True)
class Coordinator:
    """A plain table on the coordinator, reached only through it."""

    why: str


Placement = Distributed | Reference | Coordinator

# In the order they are placed: a table after the one it is co-located with or refers to.
PLACEMENT: dict[str, Placement] = {
    "conversations": Distributed("id", colocate_with="none", primary_key=("id",)),
    "turns": Distributed(
        "conversation_id",
        colocate_with="conversations",
        primary_key=("conversation_id", "seq"),
        foreign_keys=(
            ForeignKey(
                "turns_conversation_id_fkey", ("conversation_id",), "conversations", ("id",)
            ),
        ),
    ),
    # A run is found by its conversation's id too: the replica that made or read it remembers
    # it, another reads it in run_homes (the public turn id does not carry it).
    "turn_runs": Distributed(
        "conversation_id", colocate_with="conversations", primary_key=("conversation_id", "id")
    ),
    "turn_events": Distributed(
        "conversation_id",
        colocate_with="conversations",
        primary_key=("conversation_id", "turn_id", "seq"),
        foreign_keys=(
            ForeignKey(
                "turn_events_turn_id_fkey",
                ("conversation_id", "turn_id"),
                "turn_runs",
                ("conversation_id", "id"),
            ),
        ),
        fill=(
            "UPDATE turn_events e SET conversation_id = r.conversation_id FROM turn_runs r"
            " WHERE r.id = e.turn_id AND e.conversation_id IS NULL"
        ),
    ),
    # A keyed write's receipt, written in its transaction on its conversation's worker: a
    # retry that finds the claim's outcome in doubt reads it there (deploy/SCALE-OUT.md,
    # "Each owner's rows"; service/store/postgres/receipts.py).
    "idempotency_receipts": Distributed(
        "conversation_id",
        colocate_with="conversations",
        primary_key=("conversation_id", "claim_id"),
    ),
    # Each owner's rows (its Idempotency-Keys, its forks of the minute, its running turns'
    # places) on the coordinator, which every statement passes through anyway: a statement on
    # them needs no worker, so a worker down stops only the conversations placed on it, and an
    # owner's count is one local statement. Placed on a worker by owner (before issue 44), all
    # an owner's turns failed with that worker down and a turn with a key wrote two workers
    # (a two-phase commit): deploy/SCALE-OUT.md, "Each owner's rows".
    "idempotency_keys": Coordinator(
        "found by (owner, key) before the conversation is known; a keyed commit runs here"
    ),
    "owner_forks": Coordinator("counted per owner in a fork's place"),
    "owner_turns": Coordinator("each owner's running turns, taken by statements of their own"),
    # Each run's conversation, written with the run (one phase: this table and one worker) and
    # read by a replica that never saw the run, so its statements go to that one worker
    # instead of every shard (deploy/SCALE-OUT.md, "A run found by its id").
    "run_homes": Coordinator("each run's conversation, found by the run's id alone"),
    # Read by a commit on the worker of its conversation (turnstore_commit), written rarely.
    "turnstore_secrets": Reference(),
    "owner_tombstones": Reference(),
    "api_keys": Coordinator("read per request by key hash; a reference table adds nothing"),
    "owner_keys": Coordinator("the keyring: in production a database of its own"),
    "alembic_version": Coordinator("migrations run on the coordinator"),
    "keyring_version": Coordinator("migrations run on the coordinator"),
}


@dataclass(frozen=True)
class DistributedFunction:
    """A function sent whole to the worker that holds its ``argument``'s shard of
    ``colocate_with`` (when it is called on its own, autocommitted: ``SELECT * FROM f(...)``)."""

    signature: str  # as regprocedure reads it
    argument: str
    colocate_with: str


@dataclass(frozen=True)
class CoordinatorFunction:
    """A function run where it is called, on the coordinator: never sent to a worker (its
    tables are the coordinator's own)."""

    signature: str


FunctionPlacement = DistributedFunction | CoordinatorFunction

# Every function the migrations make, placed after the tables.
FUNCTIONS: dict[str, FunctionPlacement] = {
    # A turn's commit: the plain turn's one round trip, on one worker, without 2PC (v3 is this
    # release's; the first the previous release's, during a rolling upgrade; v2 that of images
    # built between migrations 0019 and 0021).
    **{
        commit.name: DistributedFunction(
            commit.signature, argument="p_cid", colocate_with="conversations"
        )
        for commit in (COMMIT, COMMIT_V2, COMMIT_V3)
    },
    # A durable turn's writes of its run (0022): on its conversation's worker, as its commit.
    **{
        function.name: DistributedFunction(
            function.signature, argument="p_cid", colocate_with="conversations"
        )
        for function in (CREATE_RUN, LOG_RUN, END_RUN, COMMIT_RUN)
    },
    # A turn's place among its owner's running turns: where its table is, on the coordinator
    # (distributed by p_owner before issue 44: `db distribute` takes that back).
    # A keyed turn's commit with its receipt (receipts.py): called on the coordinator, where
    # the key is, its statements routed to the conversation's worker.
    **{
        function.name: CoordinatorFunction(function.signature)
        for function in (COMMIT_RECEIPT, COMMIT_RUN_RECEIPT)
    },
    "turnstore_take_turn": CoordinatorFunction(
        "turnstore_take_turn(text, uuid, timestamptz, timestamptz, integer)"
    ),
}


async def distribute(
    url: str,
    *,
    shard_count: int = DEFAULT_SHARD_COUNT,
    placement: dict[str, Placement] | None = None,
    functions: dict[str, FunctionPlacement] | None = None,
    progress: Callable[[str], None] | None = None,
    owner_rows: bool = False,
) -> str:
    """Place every table of the schema at ``url`` (a Citus coordinator) as ``placement`` says;
    what was done, one line per table, or that nothing was to do. ``progress`` is told each
    table as it starts (its rows, as the statistics estimate them): a populated table is
    copied to the workers, which takes a while, under a lock that holds its writes until the
    whole placement commits.

    ``owner_rows``: each owner's rows placed on the workers by a release before issue 44 are
    made the coordinator's again (``turnstore db distribute --owner-rows``, once every replica
    runs this release: a replica of the release before sends its keyed commits to a worker,
    where the keys would no longer be); without it they are left as they are, which this
    release works with, and said (``db status`` says so too)."""
    placement = PLACEMENT if placement is None else placement
    functions = FUNCTIONS if functions is None else functions
    say = progress or (lambda _line: None)
    conn = await asyncpg.connect(**_connect_args(url))
    try:
        await _check_server(conn)
        async with conn.transaction():
            # The migrations' advisory lock: a placement and a migration never run at once.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_ID)
            await _check_schema(conn, placement, functions)
            await conn.execute(f"SET LOCAL citus.shard_count = {int(shard_count)}")
            # DDL after a distributed table was made in the same transaction must not open
            # parallel connections to the workers.
            await conn.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
            started = time.monotonic()
            later: list[str] = []
            done = await _place(conn, placement, say, later if not owner_rows else None)
            done += await _place_functions(conn, functions, later if not owner_rows else None)
            locked_s = time.monotonic() - started
    except asyncpg.PostgresError as exc:
        raise Refused(f"Citus refused the placement: {exc}".splitlines()[0]) from exc
    finally:
        await conn.close()
    if not done and not later:
        return "every table is placed already: nothing to do"
    locked = (
        f"done in one transaction: the tables placed were locked for {locked_s:.1f} s"
        " (requests that wrote them waited until it committed)"
    )
    return "\n".join([*done, *([locked] if done else []), *later])


async def _check_server(conn: asyncpg.Connection) -> None:
    citus = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
    if citus is None:
        raise Refused(
            "this server has no Citus (CREATE EXTENSION citus on the coordinator and every"
            " worker, then add the workers): nothing placed"
        )
    if not await conn.fetchval("SELECT citus_is_coordinator()"):
        raise Refused("this is not the Citus coordinator (no worker added yet?): nothing placed")


async def _check_schema(
    conn: asyncpg.Connection,
    placement: dict[str, Placement],
    functions: dict[str, FunctionPlacement],
) -> None:
    version = None
    if await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL"):
        version = await conn.fetchval("SELECT version_num FROM alembic_version")
    if version != migrate.head_revision():
        at = f"at {version}" if version else "empty"
        raise Refused(f"the schema is {at}, not at head: run `turnstore db upgrade` first")
    unnamed = set(await _tables(conn)) - set(placement)
    if unnamed:
        raise Refused(f"no placement for {', '.join(sorted(unnamed))} (service/store/placement.py)")
    unnamed = set(await _functions(conn)) - set(functions)
    if unnamed:
        raise Refused(f"no placement for function {', '.join(sorted(unnamed))}")


async def _functions(conn: asyncpg.Connection) -> list[str]:
    """The functions the migrations made (Citus' own live in other schemas)."""
    rows = await conn.fetch(
        "SELECT proname FROM pg_proc p WHERE pronamespace = 'public'::regnamespace"
        " AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = p.oid AND d.deptype = 'e')"
    )
    return [row["proname"] for row in rows]


async def _place_functions(
    conn: asyncpg.Connection, functions: dict[str, FunctionPlacement], later: list[str] | None
) -> list[str]:
    """Each function distributed by its argument, unless it is already (pg_dist_object names
    its argument's index then); one to run on the coordinator made again if it was sent to a
    worker (Citus has no call that forgets a function's argument: dropped and made again from
    its own definition, the same function, not sent anywhere)."""
    done = []
    for name, function in functions.items():
        placed = await conn.fetchval(
            "SELECT distribution_argument_index IS NOT NULL FROM pg_catalog.pg_dist_object"
            " WHERE classid = 'pg_proc'::regclass AND objid = $1::regprocedure",
            function.signature,
        )
        if isinstance(function, CoordinatorFunction):
            if placed and later is not None:
                later.append(_LATER.format(f"{name}(): sent to the owner's worker"))
            elif placed:
                definition = await conn.fetchval(
                    "SELECT pg_get_functiondef($1::regprocedure)", function.signature
                )
                await conn.execute(f"DROP FUNCTION {function.signature}")
                await conn.execute(definition)
                done.append(f"{name}(): runs on the coordinator (no longer sent to a worker)")
            continue
        if placed:
            continue
        await conn.execute(
            "SELECT create_distributed_function($1::regprocedure, $2,"
            " colocate_with => $3)",
            function.signature, function.argument, function.colocate_with,
        )  # fmt: skip
        done.append(f"{name}(): distributed by {function.argument}, with {function.colocate_with}")
    return done


async def _tables(conn: asyncpg.Connection) -> list[str]:
    rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    return [row["tablename"] for row in rows]


async def _place(
    conn: asyncpg.Connection,
    placement: dict[str, Placement],
    say: Callable[[str], None],
    later: list[str] | None,
) -> list[str]:
    tables = set(await _tables(conn))
    on_citus = {
        t: p for t, p in placement.items() if t in tables and not isinstance(p, Coordinator)
    }
    placed = await _placed(conn)
    done = await _back_to_coordinator(conn, placement, placed, say, later)
    for table, where in placement.items():
        if table in placed:
            _check_placed(table, where, placed)
    todo = [table for table in on_citus if table not in placed]
    for table in todo:  # their foreign keys first: those kept come back once all are placed
        for row in await conn.fetch(_FOREIGN_KEYS, table):
            await conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {row['conname']}")
    # A coordinator's table keeps no foreign key to one on the workers (Citus allows none):
    # deleting a conversation deletes its Idempotency-Keys itself (idempotency.DELETE_OF).
    for table in tables & {t for t, p in placement.items() if isinstance(p, Coordinator)}:
        for row in await conn.fetch(_FOREIGN_KEYS, table):
            if row["referred"] in on_citus:
                await conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {row['conname']}")
                done.append(f"{table}: foreign key {row['conname']} dropped ({row['referred']}"
                            " is on the workers)")  # fmt: skip
    if todo:
        say(f"placing {len(todo)} tables in one transaction (each locked until it commits)")
    for n, table in enumerate(todo, 1):
        rows = await conn.fetchval(
            "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = $1::regclass", table
        )
        say(f"[{n}/{len(todo)}] {table}: about {rows} rows...")
        started = time.monotonic()
        line = await _create(conn, table, on_citus[table])
        done.append(f"{line} ({time.monotonic() - started:.1f} s)")
        say(f"[{n}/{len(todo)}] {done[-1]}")
    for table, where in on_citus.items():
        for key in where.foreign_keys:
            if not await conn.fetchval(_CONSTRAINT, table, key.name):
                await conn.execute(key.ddl(table))
                done.append(f"{table}: foreign key {key.name} ({', '.join(key.columns)})")
    return done


_FOREIGN_KEYS = (
    "SELECT conname, confrelid::regclass::text AS referred FROM pg_constraint"
    " WHERE contype = 'f' AND conrelid = $1::regclass"
)
_CONSTRAINT = "SELECT 1 FROM pg_constraint WHERE conrelid = $1::regclass AND conname = $2"
_PRIMARY_KEY = (
    "SELECT conname, array(SELECT attname FROM unnest(conkey) WITH ORDINALITY AS k(n, i)"
    " JOIN pg_attribute ON attrelid = conrelid AND attnum = n ORDER BY i) AS columns"
    " FROM pg_constraint WHERE contype = 'p' AND conrelid = $1::regclass"
)


async def _back_to_coordinator(
    conn: asyncpg.Connection,
    placement: dict[str, Placement],
    placed: dict[str, Any],
    say: Callable[[str], None],
    later: list[str] | None,
) -> list[str]:
    """Tables placed on the workers by a release before, which this one keeps on the
    coordinator (issue 44: each owner's rows), made plain tables there again, their rows
    copied back (Citus' undistribute_table), or with ``later`` left and said there;
    ``placed`` forgets them."""
    done = []
    for table, where in placement.items():
        if not isinstance(where, Coordinator) or not _by_owner(placed.get(table)):
            continue
        if later is not None:
            later.append(_LATER.format(f"{table}: on the workers, by {placed[table]['column']}"))
            del placed[table]
            continue
        rows = await conn.fetchval("SELECT count(*) FROM " + table)
        say(f"{table}: {rows} rows back to the coordinator...")
        started = time.monotonic()
        await conn.execute("SELECT undistribute_table($1)", table)
        del placed[table]
        done.append(
            f"{table}: a plain table on the coordinator again, {rows} rows"
            f" ({time.monotonic() - started:.1f} s)"
        )
    return done


# Each owner's rows as a release before issue 44 placed them: left until the rollout is over.
_LATER = (
    "{}, as the release before placed it (this release works with it): once every replica"
    " runs this release, `turnstore db distribute --owner-rows` makes it the coordinator's"
)


async def _placed(conn: asyncpg.Connection) -> dict[str, Any]:
    """The tables Citus knows: how each is partitioned ('h' hash, 'n' reference), by which
    column, in which co-location group."""
    rows = await conn.fetch(
        "SELECT logicalrelid::text AS table, partmethod::text, colocationid,"
        " column_to_column_name(logicalrelid, partkey) AS column FROM pg_dist_partition"
    )
    return {row["table"]: row for row in rows}


async def _create(conn: asyncpg.Connection, table: str, where: Placement) -> str:
    if isinstance(where, Reference):
        await conn.execute("SELECT create_reference_table($1)", table)
        return f"{table}: reference table"
    assert isinstance(where, Distributed)
    if where.fill is not None:
        await conn.execute(where.fill)
    key = await conn.fetchrow(_PRIMARY_KEY, table)
    if key is None or tuple(key["columns"]) != where.primary_key:
        drop = f"DROP CONSTRAINT {key['conname']}, " if key is not None else ""
        await conn.execute(
            f"ALTER TABLE {table} {drop}ADD PRIMARY KEY ({', '.join(where.primary_key)})"
        )
    await conn.execute(
        "SELECT create_distributed_table($1, $2, colocate_with => $3)",
        table, where.column, where.colocate_with,
    )  # fmt: skip
    group = "its own group" if where.colocate_with == "none" else f"with {where.colocate_with}"
    return f"{table}: distributed by {where.column}, {group}, key ({', '.join(where.primary_key)})"


def wanted(where: Placement) -> str:
    """The placement in words."""
    if isinstance(where, Coordinator):
        return "a plain table on the coordinator"
    if isinstance(where, Reference):
        return "a reference table"
    with_group = "" if where.colocate_with == "none" else f" with {where.colocate_with}"
    return f"distributed by {where.column}{with_group}"


def _as_wanted(table: str, where: Placement, placed: dict[str, Any]) -> bool:
    """Whether the table is where the placement says (on the coordinator: not in Citus)."""
    row = placed.get(table)
    if isinstance(where, Coordinator) or row is None:
        return isinstance(where, Coordinator) and row is None
    if isinstance(where, Reference):
        return bool(row["partmethod"] == "n")
    group = placed.get(where.colocate_with)
    return bool(
        row["partmethod"] == "h"
        and row["column"] == where.column
        and (group is None or group["colocationid"] == row["colocationid"])
    )


def _by_owner(row: Any) -> bool:
    """A table Citus knows, hash-distributed (each owner's, as placed before issue 44)."""
    return row is not None and row["partmethod"] == "h"


def _check_placed(table: str, where: Placement, placed: dict[str, Any]) -> None:
    """A table placed before: as the placement says, or the operator decides."""
    if not _as_wanted(table, where, placed):
        raise Refused(f"{table} is placed otherwise than {wanted(where)}: change it by hand first")


@dataclass(frozen=True)
class CitusStatus:
    """What `turnstore db status` says of Citus: its version (None: not installed), whether
    this is the coordinator, and each table and function not placed as it should be (with
    what it should be)."""

    version: str | None
    coordinator: bool = False
    workers: int = 0
    misplaced: dict[str, str] | None = None  # table or function() -> what it should be
    # Each owner's rows as a release before issue 44 placed them (this one works with it):
    # for `db distribute --owner-rows` once the rollout is over; not counted against ``ok``.
    pending: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.version is None or (self.coordinator and not self.misplaced)


async def status(url: str) -> CitusStatus:
    """Whether the database at ``url`` is placed as this release's PLACEMENT and FUNCTIONS
    say (on plain PostgreSQL there is nothing to place)."""
    conn = await asyncpg.connect(**_connect_args(url))
    try:
        version = await conn.fetchval("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
        if version is None:
            return CitusStatus(None)
        if not await conn.fetchval("SELECT citus_is_coordinator()"):
            return CitusStatus(version)
        workers = await conn.fetchval(
            "SELECT count(*) FROM pg_dist_node WHERE groupid <> 0 AND isactive"
        )
        placed, tables = await _placed(conn), set(await _tables(conn))
        later = "after the rollout: `turnstore db distribute --owner-rows`"
        pending = {
            table: later
            for table, where in PLACEMENT.items()
            if isinstance(where, Coordinator) and _by_owner(placed.get(table))
        }
        misplaced = {
            table: wanted(where)
            for table, where in PLACEMENT.items()
            if table in tables and table not in pending and not _as_wanted(table, where, placed)
        }
        misplaced.update({t: "a table this release does not know" for t in tables - set(PLACEMENT)})
        for name, function in FUNCTIONS.items():
            argument = await conn.fetchval(
                "SELECT distribution_argument_index FROM pg_catalog.pg_dist_object"
                " WHERE classid = 'pg_proc'::regclass"
                " AND objid = to_regprocedure($1)",
                function.signature,
            )
            if isinstance(function, CoordinatorFunction):
                if argument is not None:
                    pending[f"{name}()"] = later
            elif argument is None:
                misplaced[f"{name}()"] = (
                    f"distributed by {function.argument} with {function.colocate_with}"
                )
        return CitusStatus(version, True, int(workers), misplaced, pending)
    finally:
        await conn.close()


async def worker_group(url: str) -> int | None:
    """The Citus worker group the server at ``url`` is (None: a coordinator or no Citus)."""
    conn = await asyncpg.connect(**_connect_args(url))
    try:
        if await conn.fetchval("SELECT to_regclass('pg_dist_local_group') IS NULL"):
            return None
        group = await conn.fetchval("SELECT groupid FROM pg_dist_local_group")
        return int(group) if group else None
    finally:
        await conn.close()


def _connect_args(url: str) -> dict[str, Any]:
    args = driver_connect_args(url)
    return {**args, "server_settings": {"application_name": "turnstore-distribute"}}
