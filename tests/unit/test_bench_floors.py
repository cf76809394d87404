"""The floors of the bench (bench/floors/) do turnstore's work, not an imitation of it: the
statements they run are the store's, with the same parameters in the same places, and the
reply they store is the fake provider's. (Each bench run also checks the statements on the
database and the rows they wrote; these fail before a run would.)"""

from __future__ import annotations

import dataclasses

import msgspec

from bench.floors.statements import turn_statements
from bench.floors.turn import DELTAS, Reply
from service.core.items import user_input_item
from service.providers.base import ProviderRequest, TextDelta
from service.providers.base import Reply as ProviderReply
from service.providers.fake import FakeProvider
from service.store.postgres import run_statements as runs
from service.store.postgres import running_turns
from service.store.postgres.statements import Statements


def test_the_floors_run_the_stores_own_statements() -> None:
    """The floors compile nothing of their own: a change of the store's statements reaches
    them (and a floor's parameters are named as the store's)."""
    store = Statements(retention_days=None)
    floor = turn_statements()
    # A turn on plain PostgreSQL: its place among the owner's running turns counted in them.
    assert [floor.lease.sql, floor.run_lease.sql, floor.commit.sql, floor.check.sql] == [
        store.lease[True, False].sql,
        store.lease[True, True].sql,
        store.commit[True].sql,
        store.describe.sql,
    ]
    assert floor.take is running_turns.TAKE and floor.run_create is runs.CREATE_COUNTED
    assert floor.run_log is runs.LOG and floor.run_commit is runs.COMMIT


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
        history = sum(map(len, items))  # two items with a role per earlier turn, in bytes
        floor = Reply.of(message, 2 * turn, history)
        deltas, reply = await _fake_reply([*items, user_input_item(message)], stream=True)
        assert floor.text == reply.text
        assert floor.deltas() == deltas and len(deltas) == DELTAS
        stored = [user_input_item(message), *reply.output_items]
        assert floor.replay_items == msgspec.json.encode(stored).decode()
        assert floor.sizes == sum(map(len, stored))
        assert reply.usage is not None and floor.usage == dataclasses.asdict(reply.usage)
        items += stored
