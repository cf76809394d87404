"""deploy/SCALE-OUT.md's promise, kept honest: every statement of a turn's hot path reaches
the conversation's rows through its id, so on Citus (tables distributed by the conversation
id) each one is routed to a single shard. Read from the statements as compiled for asyncpg."""

from __future__ import annotations

import re

import pytest

from service.store.postgres.statements import Statements
from service.store.postgres.tx import Compiled

STATEMENTS = Statements(retention_days=30)  # the retention filter included
HOT_PATH = {
    "load (a cold turn, or a cache revalidation)": STATEMENTS.load,
    "lease (lease + revalidate: a turn's first round trip)": STATEMENTS.lease,
    "commit of a turn (one statement; a durable turn's or fork's too)": STATEMENTS.commit[False],
    "commit of a conversation's first turn": STATEMENTS.commit[True],
    "why a commit found no row": STATEMENTS.exists,
    "lease release": STATEMENTS.release_lease,
    "lease renewal": STATEMENTS.renew_leases,
}
# For each table, the ways a statement reaches its rows through the conversation id: a bound
# id, the row a sibling CTE just wrote, or an INSERT of a bound id.
BY_ID = {
    "conversations": re.compile(
        r"conversations\.id = \$\d+|WHERE id = \$\d+|c\.id = l\.id"
        r"|INSERT INTO conversations \(id\b[^)]*\) VALUES \(\$\d+"
    ),
    "turns": re.compile(
        r"turns\.conversation_id = (\$\d+|conversations\.id)"
        r"|INSERT INTO turns \([^)]*conversation_id[^)]*\) SELECT .* head\.id"
        r"|INSERT INTO turns \([^)]*conversation_id[^)]*\) VALUES",
        re.DOTALL,
    ),
}
TABLE = re.compile(r"\b(?:FROM|JOIN|UPDATE|INTO)\s+(conversations|turns)\b")


def sql(statement: Compiled) -> str:
    """As the store runs it."""
    return statement.sql


def unrouted(text: str) -> set[str]:
    """The tables the statement uses without reaching them through the conversation id."""
    return {table for table in TABLE.findall(text) if not BY_ID[table].search(text)}


@pytest.mark.parametrize("name", HOT_PATH)
def test_every_hot_path_statement_names_its_conversation(name: str) -> None:
    text = sql(HOT_PATH[name])
    assert TABLE.search(text), f"{name}: touches no conversation table?\n{text}"
    assert unrouted(text) == set(), text


def test_the_check_catches_a_statement_without_the_conversation_id() -> None:
    """The check itself can fail: the owner's listing scans by owner, on every shard."""
    assert unrouted(sql(STATEMENTS.page)) == {"conversations"}


def test_the_idempotency_completion_is_the_one_part_keyed_otherwise() -> None:
    """In the commit statement only the Idempotency-Key's row is found by (owner, key): on
    Citus it is a co-located write only if idempotency_keys is distributed with the
    conversation (deploy/SCALE-OUT.md says how)."""
    text = sql(STATEMENTS.commit[False])
    completed = text[text.index("UPDATE idempotency_keys") :]
    assert "idempotency_keys.owner = " in completed and "idempotency_keys.key = " in completed
    assert "FROM head" in completed  # the key is completed only with the commit's own row
