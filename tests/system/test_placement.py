"""Every table has a placement on Citus (service/store/postgres/placement.py), and `turnstore db
distribute` applies it: once, completely, and never twice. The first tests run on plain
PostgreSQL; the rest on the local Citus cluster (tests/support/citus.py), skipped without it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

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
from service import cli
from service.platform import migrate
from service.store.postgres.placement import (
    FUNCTIONS,
    PLACEMENT,
    Coordinator,
    CoordinatorFunction,
    Distributed,
    DistributedFunction,
    Reference,
    Refused,
    distribute,
    status,
)
from tests.conftest import CITUS_SHARD_COUNT
from tests.support.citus import CitusCluster, citus_database
from tests.support.database import asyncpg_dsn


async def _fetch(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


def fetch(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    return asyncio.run(_fetch(url, query, *args))


def tables(url: str) -> set[str]:
    rows = fetch(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    return {row["tablename"] for row in rows}


def unplaced(url: str) -> set[str]:
    return tables(url) - set(PLACEMENT)


def test_every_table_of_the_schema_has_a_placement(database_url: str) -> None:
    """A migration that adds a table must say how it is placed on Citus: name it in
    PLACEMENT (distributed by which column and with which table, reference, or coordinator)."""
    assert unplaced(database_url) == set(), "name these in service/store/postgres/placement.py"
    assert set(PLACEMENT) - tables(database_url) == set(), "a table in PLACEMENT is gone"


def test_the_check_catches_a_table_a_migration_added(database_url: str) -> None:
    fetch(database_url, "CREATE TABLE scratch_added (id uuid PRIMARY KEY)")
    try:
        assert unplaced(database_url) == {"scratch_added"}
    finally:
        fetch(database_url, "DROP TABLE scratch_added")


FUNCTIONS_OF_SCHEMA = (
    "SELECT p.oid::regprocedure::text AS signature, proname FROM pg_proc p"
    " WHERE pronamespace = 'public'::regnamespace"
)


def test_every_function_of_the_schema_is_placed_with_its_signature(database_url: str) -> None:
    """A migration that adds a function names it in FUNCTIONS (distributed by which argument,
    with which table), by the signature it has: `db distribute` refuses an unnamed one."""
    found = {row["proname"]: row["signature"] for row in fetch(database_url, FUNCTIONS_OF_SCHEMA)}
    assert set(found) == set(FUNCTIONS)
    for name, function in FUNCTIONS.items():
        signature = fetch(database_url, "SELECT $1::regprocedure::text AS s", function.signature)
        assert signature[0]["s"] == found[name], name


def test_the_commit_functions_take_the_arguments_the_code_binds(database_url: str) -> None:
    """The migrations carry their own text of each commit function; the code binds its
    arguments by the names and order migrations/commit_function.py gives: the two agree."""
    for function in (COMMIT, COMMIT_V2, COMMIT_V3, CREATE_RUN, LOG_RUN, END_RUN, COMMIT_RUN):
        rows = fetch(
            database_url,
            "SELECT proargnames[1:pronargs] AS names FROM pg_proc WHERE oid = $1::regprocedure",
            function.signature,
        )
        assert rows[0]["names"] == [f"p_{name}" for name, _ in function.arguments]


def test_the_function_check_catches_a_function_a_migration_added(database_url: str) -> None:
    fetch(database_url, "CREATE FUNCTION scratch_added() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    try:
        names = {row["proname"] for row in fetch(database_url, FUNCTIONS_OF_SCHEMA)}
        assert names - set(FUNCTIONS) == {"scratch_added"}
    finally:
        fetch(database_url, "DROP FUNCTION scratch_added()")


def test_the_placement_keeps_citus_rules() -> None:
    """Keys hold the distribution column; a table joins a group placed before it, on a column
    of the same meaning; foreign keys run within a group or to a reference table."""
    order = list(PLACEMENT)
    for table, where in PLACEMENT.items():
        if isinstance(where, Coordinator):
            continue
        if isinstance(where, Distributed):
            assert where.column in where.primary_key, table
            if where.colocate_with != "none":
                group = PLACEMENT[where.colocate_with]
                assert isinstance(group, Distributed), table
                assert order.index(where.colocate_with) < order.index(table), table
        for key in where.foreign_keys:
            target = PLACEMENT[key.table]
            assert order.index(key.table) < order.index(table), (table, key.name)
            if isinstance(where, Distributed) and not isinstance(target, Reference):
                assert isinstance(target, Distributed), (table, key.name)
                assert where.column in key.columns, (table, key.name)
                assert target.column == key.referred[key.columns.index(where.column)]
                assert _group(table) == _group(key.table), (table, key.name)


def _group(table: str) -> str:
    where = PLACEMENT[table]
    assert isinstance(where, Distributed)
    return table if where.colocate_with == "none" else _group(where.colocate_with)


def test_distribute_refuses_a_server_without_citus(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = "SELECT conname FROM pg_constraint WHERE contype IN ('p', 'f') ORDER BY 1"
    before = fetch(database_url, keys)
    monkeypatch.setenv("DATABASE_URL", database_url)
    with pytest.raises(SystemExit) as exit:
        cli.main(["db", "distribute"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("turnstore db: this server has no Citus") and err.count("\n") == 1
    assert fetch(database_url, keys) == before  # nothing dropped on the way


# --- on Citus -------------------------------------------------------------------------------


def placement_of(url: str) -> dict[str, tuple[str, str | None, int]]:
    rows = fetch(
        url,
        "SELECT logicalrelid::text AS t, partmethod::text AS method, colocationid AS grp,"
        " column_to_column_name(logicalrelid, partkey) AS col FROM pg_dist_partition",
    )
    return {row["t"]: (row["method"], row["col"], row["grp"]) for row in rows}


def constraints(url: str) -> set[tuple[str, str, str]]:
    rows = fetch(
        url,
        "SELECT conrelid::regclass::text AS t, conname, pg_get_constraintdef(oid) AS def"
        " FROM pg_constraint WHERE contype IN ('p', 'f', 'u')"
        " AND connamespace = 'public'::regnamespace",
    )
    return {(row["t"], row["conname"], row["def"]) for row in rows}


def test_distribute_places_every_table_as_written(citus_url: str) -> None:
    placed = placement_of(citus_url)
    for table, where in PLACEMENT.items():
        if isinstance(where, Coordinator):
            assert table not in placed, table
        elif isinstance(where, Reference):
            assert placed[table][0] == "n", table
        else:
            method, column, group = placed[table]
            assert (method, column) == ("h", where.column), table
            assert group == placed[_group(table)][2], table
    kept = {
        (table, key.name)
        for table, where in PLACEMENT.items()
        if not isinstance(where, Coordinator)
        for key in where.foreign_keys
    }
    found = {(t, name) for t, name, d in constraints(citus_url) if d.startswith("FOREIGN")}
    assert found == kept
    keys = {t: d for t, name, d in constraints(citus_url) if d.startswith("PRIMARY")}
    for table, where in PLACEMENT.items():
        if isinstance(where, Distributed):
            assert keys[table] == f"PRIMARY KEY ({', '.join(where.primary_key)})"


def test_a_second_distribute_changes_nothing(
    citus_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = "SELECT logicalrelid::text, count(*) FROM pg_dist_shard GROUP BY 1 ORDER BY 1"
    before = (placement_of(citus_url), constraints(citus_url), fetch(citus_url, shards))
    monkeypatch.setenv("DATABASE_URL", citus_url)
    cli.main(["db", "distribute"])  # returns: exit status 0
    assert capsys.readouterr().out == "every table is placed already: nothing to do\n"
    assert (placement_of(citus_url), constraints(citus_url), fetch(citus_url, shards)) == before


@pytest.fixture
def scratch_table(citus_url: str) -> Iterator[str]:
    """A table a later migration might add (it is dropped afterwards)."""
    name = f"scratch_{uuid.uuid4().hex[:8]}"
    fetch(
        citus_url,
        f"CREATE TABLE {name} (conversation_id uuid NOT NULL, n int NOT NULL,"
        " PRIMARY KEY (conversation_id, n))",
    )
    try:
        yield name
    finally:
        fetch(citus_url, f"DROP TABLE {name}")


def test_a_table_without_placement_is_refused_and_a_placed_one_joins_its_group(
    citus_url: str, scratch_table: str
) -> None:
    with pytest.raises(Refused, match=f"no placement for {scratch_table}"):
        asyncio.run(distribute(citus_url))
    assert scratch_table not in placement_of(citus_url)
    with_it = {**PLACEMENT, scratch_table: Distributed(
        "conversation_id", colocate_with="conversations", primary_key=("conversation_id", "n")
    )}  # fmt: skip
    done = asyncio.run(distribute(citus_url, placement=with_it))
    assert done.startswith(f"{scratch_table}: distributed by conversation_id, with conversations")
    placed = placement_of(citus_url)
    assert placed[scratch_table][2] == placed["conversations"][2]
    assert asyncio.run(distribute(citus_url, placement=with_it)).endswith("nothing to do")
    as_reference = {**PLACEMENT, scratch_table: Reference()}
    with pytest.raises(Refused, match=f"{scratch_table} is placed otherwise than a reference"):
        asyncio.run(distribute(citus_url, placement=as_reference))


def test_rows_written_before_distributing_are_kept_and_their_events_placed(
    citus: CitusCluster,
) -> None:
    """A database in use before it moved to Citus: events written without their
    conversation's id (as before migration 0012) get it from their run."""
    cid, run = uuid.uuid4(), uuid.uuid4()
    with citus_database(citus) as url:
        migrate.upgrade(url)
        fetch(
            url,
            "WITH c AS (INSERT INTO conversations (id, revision, created_at, updated_at, owner)"
            " VALUES ($1, 0, now(), now(), 'o') RETURNING id),"
            " r AS (INSERT INTO turn_runs (id, conversation_id, owner, background, status,"
            " heartbeat_until) SELECT $2, id, 'o', false, 'queued', now() FROM c RETURNING id)"
            " INSERT INTO turn_events (turn_id, seq, events) SELECT id, 1, '[]' FROM r",
            cid,
            run,
        )
        asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        rows = fetch(url, "SELECT conversation_id, turn_id FROM turn_events")
        assert [tuple(row) for row in rows] == [(cid, run)]
        assert placement_of(url)["turn_events"][:2] == ("h", "conversation_id")
        # A row without its conversation's id is refused from now on.
        with pytest.raises(asyncpg.PostgresError):
            fetch(url, "INSERT INTO turn_events (turn_id, seq, events) VALUES ($1, 2, '[]')", run)


def test_0019_on_a_distributed_coordinator_places_its_tables_before_the_next_distribute(
    citus: CitusCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet on Citus distributed at 0018 is upgraded while the previous release serves:
    its commit (turnstore_commit, run on the conversation's worker) reads 0019's tombstones
    there at once, so 0019 makes them reference tables itself (a turn failed on every worker
    until `db distribute` ran again); the next `db distribute` places the rest."""
    with citus_database(citus) as url:
        migrate.upgrade(url, "0018")
        placement = {t: p for t, p in PLACEMENT.items() if t not in NEW_IN_0019}
        functions = {f: p for f, p in FUNCTIONS.items() if f not in NEW_FUNCTIONS}
        with monkeypatch.context() as patched:
            patched.setattr(migrate, "head_revision", lambda: "0018")
            asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT, placement=placement,
                                   functions=functions))  # fmt: skip
        migrate.upgrade(url)
        references = fetch(
            url,
            "SELECT logicalrelid::text AS name FROM pg_dist_partition WHERE partmethod = 'n'",
        )
        assert {row["name"] for row in references} >= NEW_IN_0019
        committed = fetch(url, OLD_COMMIT, uuid.uuid4(), "alice")  # as the previous release
        assert [row["revision"] for row in committed] == [1]
        placed = asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        assert placed.splitlines()[0] == (
            "turnstore_commit_v2(): distributed by p_cid, with conversations"
        )


def test_0021_and_0022_on_a_distributed_coordinator_distribute_their_functions_themselves(
    citus: CitusCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet on Citus distributed at 0019 is upgraded: this release's first commits
    (turnstore_commit_v3) and runs (0022's functions) run on their conversation's worker
    before `db distribute` runs again, as 0021 and 0022 distribute their functions
    themselves; the next `db distribute` has nothing to do."""
    with citus_database(citus) as url:
        migrate.upgrade(url, "0019")
        later = {COMMIT_V3.name, *RUN_FUNCTIONS}
        functions = {f: p for f, p in FUNCTIONS.items() if f not in later | RECEIPT_FUNCTIONS}
        with monkeypatch.context() as patched:
            patched.setattr(migrate, "head_revision", lambda: "0019")
            asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT, functions=functions))
        migrate.upgrade(url)
        for name in later:
            placed = fetch(
                url,
                "SELECT distribution_argument_index AS argument FROM pg_catalog.pg_dist_object"
                " WHERE classid = 'pg_proc'::regclass AND objid = $1::regprocedure",
                FUNCTIONS[name].signature,
            )
            assert [row["argument"] for row in placed] == [0], name  # p_cid
        again = asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        assert again == "every table is placed already: nothing to do"


NEW_IN_0019 = {"turnstore_secrets", "owner_tombstones"}
RUN_FUNCTIONS = {f.name for f in (CREATE_RUN, LOG_RUN, END_RUN, COMMIT_RUN)}  # 0022's
RECEIPT_FUNCTIONS = {COMMIT_RECEIPT.name, COMMIT_RUN_RECEIPT.name}  # 0024's
NEW_FUNCTIONS = {COMMIT_V2.name, COMMIT_V3.name, *RUN_FUNCTIONS, *RECEIPT_FUNCTIONS}
# The previous release's commit of a first turn, as it calls the function.
OLD_COMMIT = (
    "SELECT revision FROM turnstore_commit($1, 0, $2, NULL, 1, NULL, NULL, NULL, 'u', 'a',"
    " '[]', NULL, NULL, NULL, 1, NULL, NULL, 'completed', NULL, NULL, NULL, NULL, NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
)


# Each owner's rows as the releases before issue 44 placed them: on a worker, by owner.
BY_OWNER = {
    "idempotency_keys": Distributed("owner", colocate_with="none", primary_key=("owner", "key")),
    "owner_forks": Distributed(
        "owner", colocate_with="idempotency_keys", primary_key=("owner", "conversation_id")
    ),
    "owner_turns": Distributed(
        "owner", colocate_with="idempotency_keys", primary_key=("owner", "place")
    ),
}
TAKE_TURN = FUNCTIONS["turnstore_take_turn"]
SENT_TO_WORKER = (
    "SELECT distribution_argument_index AS argument FROM pg_catalog.pg_dist_object"
    " WHERE classid = 'pg_proc'::regclass AND objid = $1::regprocedure"
)


def test_distribute_takes_each_owners_rows_back_to_the_coordinator(citus: CitusCluster) -> None:
    """A cluster placed by a release before issue 44 (each owner's rows on a worker, its
    running turns' function sent there): `db distribute` as the migration Job runs it (before
    the rollout, while replicas of the release before still send their keyed commits to the
    workers) leaves them and says so, and `db status` is ok with them pending; `db distribute
    --owner-rows` (after the rollout) makes them the coordinator's own tables again, their rows
    kept, and the function runs where it is called; `db status` says nothing after; a third run
    has nothing to do."""
    assert isinstance(TAKE_TURN, CoordinatorFunction)
    old = {t: BY_OWNER.get(t, p) for t, p in PLACEMENT.items()}
    by_owner = DistributedFunction(TAKE_TURN.signature, "p_owner", "idempotency_keys")
    with citus_database(citus) as url:
        migrate.upgrade(url)
        asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT, placement=old,
                               functions={**FUNCTIONS, "turnstore_take_turn": by_owner}))  # fmt: skip
        assert set(BY_OWNER) <= set(placement_of(url))
        fetch(
            url,
            "INSERT INTO idempotency_keys (owner, key, request_hash, state, created_at,"
            " expires_at) VALUES ('alice', 'k', 'h', 'running', now(), now() + interval '1 h')",
        )
        before = asyncio.run(status(url))
        assert before.ok and not before.misplaced
        assert set(before.pending or {}) == {*BY_OWNER, "turnstore_take_turn()"}
        left = asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT)).splitlines()
        assert len(left) == 4 and all("--owner-rows" in line for line in left), left
        assert set(BY_OWNER) <= set(placement_of(url))  # left where the old release has them
        done = asyncio.run(
            distribute(url, shard_count=CITUS_SHARD_COUNT, owner_rows=True)
        ).splitlines()
        assert [line.split(",")[0] for line in done[:3]] == [
            f"{table}: a plain table on the coordinator again" for table in BY_OWNER
        ]
        assert "turnstore_take_turn(): runs on the coordinator (no longer sent to a worker)" in done
        assert not set(BY_OWNER) & set(placement_of(url))
        assert [row["argument"] for row in fetch(url, SENT_TO_WORKER, TAKE_TURN.signature)] in (
            [], [None]
        )  # fmt: skip
        assert [tuple(r) for r in fetch(url, "SELECT owner, key FROM idempotency_keys")] == [
            ("alice", "k")
        ]
        taken = "SELECT taken FROM turnstore_take_turn('alice', gen_random_uuid(), now(),"
        assert fetch(url, taken + " now() + interval '1 min', 1)")[0]["taken"] is True
        after = asyncio.run(status(url))
        assert after.ok and not after.pending
        again = asyncio.run(distribute(url, shard_count=CITUS_SHARD_COUNT))
        assert again == "every table is placed already: nothing to do"
