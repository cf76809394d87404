"""The statements a turn runs, as turnstore's PostgreSQL store runs them: the store's own named
statements (service/store/postgres/), compiled once for asyncpg, so a change there reaches the
floors. A floor fills them per request with a plain dict, without SQLAlchemy.

The bench checks from pg_stat_statements that the floors ran the same statements as turnstore
(same query ids), and from the rows that they wrote the same bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.store.postgres import run_statements as runs
from service.store.postgres import running_turns
from service.store.postgres.statements import Statements
from service.store.postgres.tx import Compiled as Statement

__all__ = ["Nulls", "Statement", "TurnStatements", "turn_statements"]


class Nulls(dict[str, Any]):
    """A statement's parameters: a column the floor does not set (a sealed one, a key) NULL,
    as turnstore leaves it for a turn in clear without an Idempotency-Key."""

    def __missing__(self, name: str) -> None:
        return None


@dataclass(frozen=True)
class TurnStatements:
    lease: Statement  # take the lease (and the turn's place among the owner's running
    # turns) and read the turns after :after (one statement)
    take: Statement  # a new conversation's first turn: its place among the running turns
    commit: Statement  # the conditional bump (or a new conversation), the turn row, the
    # Idempotency-Key: one call of turnstore_commit(), the turn's place given back
    check: Statement  # the streamed turn's check before its stream starts
    create_empty: Statement  # POST /v1/conversations (not measured: before the turns)
    wake: Statement  # after a commit that released a lease others wait for
    run_create: Statement  # a streamed turn runs as a durable run: its row and place,
    run_lease: Statement  # its lease, which begins it (as lease),
    run_begin: Statement  # or its start on a new conversation (no lease),
    run_log: Statement  # its events so far, logged before the commit,
    run_commit: Statement  # and its end, in the commit's transaction


def turn_statements() -> TurnStatements:
    sql = Statements(retention_days=None)  # RETENTION_DAYS unset, as the bench serves
    return TurnStatements(
        lease=sql.lease[True, False],  # plain PostgreSQL: the places in the turn's statements
        run_lease=sql.lease[True, True],
        take=running_turns.TAKE,
        commit=sql.commit[True],
        check=sql.describe,
        create_empty=sql.new_conversation,
        wake=sql.wake,
        run_create=runs.CREATE_COUNTED,
        run_begin=runs.BEGIN,
        run_log=runs.LOG,
        run_commit=runs.COMMIT,
    )
