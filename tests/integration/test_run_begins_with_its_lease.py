"""A run's lease begins it (LeaseRequest.run): a streamed or background turn on a conversation
that exists sends no statement of its own to mark its run in progress, one round trip less
before its provider is called. Counted over the statements an app's pool sends
(tests/support/turn_kinds.py); `make bench` part 12 prints each kind's round trips."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.events import TURNS, background
from tests.support.fakeapi import Script
from tests.support.turn_kinds import Replica, kinds, prepare, replica

BEGINS = "SET status = 'in_progress'"


@pytest.mark.parametrize("kind", ["streamed /api/v1", "background", "/v1 streamed"])
async def test_a_runs_lease_begins_it(database: str, kind: str) -> None:
    async with replica(database, 0.0) as r:
        made = await prepare(r)
        before = len(r.log.queries)
        await r.measure(kinds(made)[kind])
        begins = [q for q in r.log.queries[before:] if BEGINS in q]
        assert len(begins) == 1 and "lease_holder" in begins[0], begins


async def test_a_new_conversations_run_begins_by_itself(database: str) -> None:
    """No lease to take: its begin is a statement of its own."""

    async def new_in_background(r: Replica) -> None:
        await background(r.client, message="hello")

    async with replica(database, 0.0) as r:
        before = len(r.log.queries)
        await r.measure(new_in_background)
        begins = [q for q in r.log.queries[before:] if BEGINS in q]
        assert len(begins) == 1 and "lease_holder" not in begins[0], begins


async def test_a_run_begun_by_its_lease_is_in_progress_while_its_provider_answers(
    database: str,
) -> None:
    """The statement's CTE did update the run (a status read says so, as with BEGIN)."""
    async with replica(database, 0.0) as r:
        made = await prepare(r)
        answer = Script(gate=asyncio.Event())
        r.api.then(answer)
        started = await background(r.client, message="hi", conversation_id=made.chat)
        await answer.started.wait()
        status = await r.client.get(f"{TURNS}/{started['turn_id']}")
        assert status.json()["status"] == "in_progress", status.text
        assert answer.gate is not None
        answer.gate.set()
