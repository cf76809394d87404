"""deploy/SCALE-OUT.md's promise, kept honest on a real Citus cluster (tests/support/citus.py: a
coordinator and two workers, migrated and placed as `turnstore db upgrade` and `turnstore db
distribute` do): every statement of a turn's hot path is planned by the coordinator as one
task, on the worker that holds the conversation (``EXPLAIN``: ``Task Count: 1``), and a plain
turn commits there without a two-phase commit. Plans, not SQL text: a statement Citus would
fan out, or refuse, fails here. Skipped where Citus is not installed (not in CI)."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from service.core.model import Append, LeaseRequest, Turn
from service.platform.db import create_engine
from service.store.postgres import PostgresStore, StoreConfig, receipts, running_turns
from service.store.postgres import idempotency as idem
from service.store.postgres import run_statements as runs
from service.store.postgres.placement import PLACEMENT, Reference
from service.store.postgres.rows import Rows
from service.store.postgres.statements import Statements
from service.store.postgres.tx import Compiled
from tests.conftest import CITUS_SHARD_COUNT
from tests.support.database import asyncpg_dsn

STATEMENTS = Statements(retention_days=30)  # the retention filter included
HOT_PATH = {
    "load (a cold turn, or a cache revalidation)": STATEMENTS.load,
    # On Citus the lease and the commit leave the running turns' places to their own
    # statements (the places live on the coordinator: OWNERS_ROWS): the variants that do.
    "lease (lease + revalidate: a turn's first round trip)": STATEMENTS.lease[False, False],
    "a run's lease, which begins it": STATEMENTS.lease[False, True],
    "commit of a turn, or of a conversation's first (turnstore_commit)": STATEMENTS.commit[False],
    "why a commit found no row": STATEMENTS.exists,
    "lease release": STATEMENTS.release_lease,
    "the check before a streamed turn's stream": STATEMENTS.describe,
    "a transcript page's sizes": STATEMENTS.page_sizes[False],
    "a transcript page's rows": STATEMENTS.page_rows,
    # An Idempotency-Key's receipt (receipts.py): written in a keyed write's transaction, read
    # by a retry that finds its claim in doubt, on the conversation's worker.
    "a keyed write's receipt": receipts.WRITE,
    "a claim in doubt's receipt read": receipts.RECEIPT,
    "a fence in the place of a claim in doubt's receipt": receipts.FENCE,
}
# Each owner's rows are the coordinator's own (placement.py, issue 44): their statements
# need no worker, so a worker down stops none of them.
OWNERS_ROWS = {
    "a running turn's place taken (turnstore_take_turn)": running_turns.TAKE,
    "a running turn's place given back": running_turns.FREE,
    "running turns' places renewed": running_turns.RENEW,
    "an Idempotency-Key claimed": idem.CLAIM,
    "an Idempotency-Key's record read": idem.EXISTING,
    "an Idempotency-Key claimed with the conversation it writes": receipts.CLAIM,
    "its record read, the claim's conversation with it": receipts.EXISTING,
    "a claim in doubt completed from its receipt": receipts.SETTLE,
    "a claim in doubt without a receipt taken over": receipts.TAKEOVER,
    "a claim that did not commit lapsed": receipts.RELEASE,
}
TASKS = re.compile(r"Task Count: (\d+)")
SHARD = re.compile(r" on ([a-z_]+)_\d{6}\b")  # a shard scanned: its table's name, its number
REFERENCE = {t for t, where in PLACEMENT.items() if isinstance(where, Reference)}


class Values(dict[str, Any]):
    """A statement's parameters: the conversation's id and plausible values; NULL for the
    rest (a sealed column, an Idempotency-Key)."""

    def __missing__(self, name: str) -> None:
        return None


def values(cid: uuid.UUID) -> Values:
    now = datetime.now(UTC)
    turn = Turn("hi", "hello", [msgspec.Raw(b'{"type":"message"}')])
    return Values(
        Rows(None, cid).turn_columns(2, turn, None),
        cid=cid, caller="owner", after=0, holder=uuid.uuid4(), queue=True, now=now,
        until=now + timedelta(seconds=30), seq=1, expected=1, context_start=1, ttl_s=60.0,
        before=2**31 - 1, fetch=11, seqs=[1, 2], writing=cid,
    )  # fmt: skip


async def _plan(url: str, statement: Compiled, params: Values) -> str:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows = await conn.fetch(f"EXPLAIN (COSTS OFF) {statement.sql}", *statement.args(params))
    finally:
        await conn.close()
    return "\n".join(row[0] for row in rows)


def tasks(url: str, statement: Compiled) -> int:
    """How many tasks (shards) the coordinator plans the statement as."""
    plan = asyncio.run(_plan(url, statement, values(uuid.uuid4())))
    found = TASKS.findall(plan)
    assert found, f"not a distributed plan:\n{plan}"
    return sum(int(n) for n in found)


@pytest.mark.parametrize("name", HOT_PATH)
def test_every_hot_path_statement_runs_on_one_shard(citus_url: str, name: str) -> None:
    assert tasks(citus_url, HOT_PATH[name]) == 1


@pytest.mark.parametrize("name", OWNERS_ROWS)
def test_each_owners_rows_need_no_worker(citus_url: str, name: str) -> None:
    """Planned on the coordinator; a shard it reads is a reference table's (the shred's
    tombstones: a copy on every node, the coordinator's among them)."""
    plan = asyncio.run(_plan(citus_url, OWNERS_ROWS[name], values(uuid.uuid4())))
    assert not plan.startswith("Custom Scan (Citus"), plan
    assert set(SHARD.findall(plan)) <= REFERENCE, plan


def test_the_check_fails_on_a_statement_that_fans_out(citus_url: str) -> None:
    """The check itself can fail: the owner's listing scans by owner, on every shard."""
    assert tasks(citus_url, STATEMENTS.page) == CITUS_SHARD_COUNT


async def _prepared(conn: asyncpg.Connection) -> int:
    """Two-phase commits the coordinator made (citus.recover_2pc_interval is off in the test
    cluster, so none is forgotten meanwhile)."""
    return int(await conn.fetchval("SELECT count(*) FROM pg_dist_transaction"))


async def _turns_and_2pc(url: str) -> tuple[int, int]:
    """A new conversation's first turn and three more, plain, each with its counted place
    among the owner's running turns: the two-phase commits of the first, and of the later
    ones."""
    engine = create_engine(url, pool_size=2)
    store = PostgresStore.over(engine, StoreConfig(running_turns=16))
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        cid, turn = uuid.uuid4(), Turn("hi", "hello", [msgspec.Raw(b'{"type":"message"}')])
        before = await _prepared(conn)
        first_turn = uuid.uuid4()
        assert await store.places.take_turn("owner", first_turn, 30)
        await store.history.append(Append(cid, turn, 0, owner="owner", lease=first_turn))
        first = await _prepared(conn) - before
        for revision in (1, 2, 3):
            holder = uuid.uuid4()
            leased = await store.history.lease(
                LeaseRequest(cid, "owner", holder, lease_s=30, queue=False)
            )
            assert leased.acquired
            await store.history.append(Append(cid, turn, revision, owner="owner", lease=holder))
        return first, await _prepared(conn) - before - first
    finally:
        await conn.close()
        await engine.dispose()


def test_a_plain_turn_commits_on_one_worker_without_a_two_phase_commit(citus_url: str) -> None:
    assert asyncio.run(_turns_and_2pc(citus_url)) == (0, 0)


async def _fan_out_2pc(url: str) -> int:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        before = await _prepared(conn)
        await conn.execute(runs.EXPIRED.sql)  # a DELETE on every shard of the runs
        return await _prepared(conn) - before
    finally:
        await conn.close()


def test_the_two_phase_count_sees_a_write_on_both_workers(citus_url: str) -> None:
    """The 2PC check itself can fail: a write to every shard commits in two phases on each
    worker that holds some."""
    assert asyncio.run(_fan_out_2pc(citus_url)) >= 2
