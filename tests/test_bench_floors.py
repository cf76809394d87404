"""The floors of the bench (bench/floors/) do turnstore's work, not an imitation of it: the
statements they run are the store's, with the same parameters in the same places, and the
reply they store is the fake provider's. (Each bench run also checks the statements on the
database and the rows they wrote; these fail before a run would.)"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect

from bench.floors.statements import compile_statement
from bench.floors.turn import DELTAS, Reply
from service.providers.base import ProviderRequest, TextDelta, user_input_item
from service.providers.base import Reply as ProviderReply
from service.providers.fake import FakeProvider
from service.store import runs
from service.store.postgres import _WAKE, _Statements
from service.store.tx import Compiled

_SQL = _Statements(retention_days=None)
_VALUES: dict[str, Any] = {
    "cid": uuid.uuid4(), "caller": "anonymous", "holder": uuid.uuid4(), "replaces": None,
    "lease_s": 30.0, "queue": True, "after": 3, "user_message": "hello", "revision": 1,
    "assistant_message": "[fake-llm] hello", "replay_items": "[]", "provider": "fake",
    "endpoint": "builtin", "model": "fake-llm", "context_from": 1, "prompt_version": None,
    "tool_calls": None, "status": "completed", "incomplete_reason": None, "turn_id": None,
    "sealed_user_message": None, "sealed_assistant_message": None, "sealed_replay_items": None,
    "sealed_tool_calls": None, "expected": 3, "context_start": 1, "metadata": None,
    "ttl_s": 86400.0, "idem_key": None, "sealed_metadata": None, "id": uuid.uuid4(),
    "owner": "anonymous", "background": False, "hb": 30.0, "last": 4, "events": "[]",
    "sealed_events": None, "seq": 5, "ttl": 600.0, "topics": ["lease:x"],
}  # fmt: skip


@pytest.mark.parametrize(
    "statement",
    [
        _SQL.lease, _SQL.commit[False], _SQL.commit[True], _SQL.load, _SQL.create_empty, _WAKE,
        runs.CREATE, runs.BEGIN, runs.LOG, runs.COMMIT,
    ],
    ids=["lease", "commit", "commit-new", "load", "create-empty", "wake", "run-create",
         "run-begin", "run-log", "run-commit"],
)  # fmt: skip
def test_a_floor_statement_is_the_stores_with_its_arguments(statement: sa.Executable) -> None:
    store = Compiled(statement, asyncpg_dialect())  # type: ignore[no-untyped-call]
    floor = compile_statement(statement)
    assert floor.sql == store.sql
    assert floor.args(_VALUES) == store.args(_VALUES)
    changed = {**_VALUES, "cid": uuid.uuid4(), "expected": 7, "after": 7}
    assert floor.args(changed) == store.args(changed)


async def _fake_reply(items: list[msgspec.Raw], stream: bool) -> tuple[list[str], ProviderReply]:
    deltas, reply = [], None
    async for event in FakeProvider().respond(ProviderRequest(items), stream=stream):
        if isinstance(event, TextDelta):
            deltas.append(event.text)
        elif isinstance(event, ProviderReply):
            reply = event
    assert reply is not None
    return deltas, reply


async def test_a_floor_stores_the_fake_providers_reply_after_any_history() -> None:
    items: list[msgspec.Raw] = []
    for turn in range(4):
        message = f"message number {turn}, with some words"
        floor = Reply.of(message, 2 * turn)  # two items with a role per earlier turn
        deltas, reply = await _fake_reply([*items, user_input_item(message)], stream=True)
        assert floor.text == reply.text
        assert floor.deltas() == deltas and len(deltas) == DELTAS
        stored = [user_input_item(message), *reply.output_items]
        assert floor.replay_items == msgspec.json.encode(stored).decode()
        items += stored
