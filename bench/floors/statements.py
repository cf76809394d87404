"""The statements a turn runs, as turnstore's PostgreSQL store runs them: the SQL compiled
once for asyncpg from the store's own Core statements (so a change there reaches the floors),
and each statement's parameters in order. A floor fills them per request with a plain list,
not with SQLAlchemy: what SQLAlchemy costs per request is part of what the floors measure.

The bench checks from pg_stat_statements that the floors ran the same statements as turnstore
(same query ids), and from the rows that they wrote the same bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

# Where turnstore keeps them today (the store's layout may move: only these imports follow).
from service.store import runs
from service.store.postgres import _WAKE, _Statements


@dataclass(frozen=True)
class Statement:
    """SQL with $n parameters; ``args`` puts a request's values in their places."""

    sql: str
    _slots: tuple[tuple[int, str], ...]  # (position, name) of what a request gives
    _template: tuple[Any, ...]  # constants of the statement (e.g. `revision + 1`) in place

    def args(self, values: dict[str, Any]) -> list[Any]:
        args = list(self._template)
        for position, name in self._slots:
            args[position] = values[name]
        return args


def compile_statement(statement: sa.Executable) -> Statement:
    compiled = statement.compile(dialect=asyncpg_dialect())  # type: ignore[attr-defined,no-untyped-call]
    names = tuple(compiled.positiontup or ())
    template: list[Any] = []
    slots: list[tuple[int, str]] = []
    for position, name in enumerate(names):
        bind = compiled.binds[name]
        if bind.required:
            template.append(None)  # given per request (a bindparam of the store's)
            slots.append((position, name))
        else:
            template.append(bind.effective_value)  # a constant SQLAlchemy bound for us
    return Statement(str(compiled), tuple(slots), tuple(template))


@dataclass(frozen=True)
class TurnStatements:
    lease: Statement  # take the lease and read the turns after :after (one statement)
    commit: Statement  # the conditional bump, the turn row, the Idempotency-Key: one statement
    commit_new: Statement  # the same over a new conversation (or an empty /v1 one)
    load: Statement  # the streamed turn's check before its stream starts
    create_empty: Statement  # POST /v1/conversations (not measured: before the turns)
    wake: Statement  # after a commit that released a lease others wait for
    run_create: Statement  # a streamed turn runs as a durable run: its row,
    run_begin: Statement  # its start once the lease is held,
    run_log: Statement  # its events so far, logged before the commit,
    run_commit: Statement  # and its end, in the commit's transaction


def turn_statements() -> TurnStatements:
    sql = _Statements(retention_days=None)  # RETENTION_DAYS unset, as the bench serves
    return TurnStatements(
        lease=compile_statement(sql.lease),
        commit=compile_statement(sql.commit[False]),
        commit_new=compile_statement(sql.commit[True]),
        load=compile_statement(sql.load),
        create_empty=compile_statement(sql.create_empty),
        wake=compile_statement(_WAKE),
        run_create=compile_statement(runs.CREATE),
        run_begin=compile_statement(runs.BEGIN),
        run_log=compile_statement(runs.LOG),
        run_commit=compile_statement(runs.COMMIT),
    )
