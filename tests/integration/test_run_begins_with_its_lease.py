"""A run's lease begins it (LeaseRequest.run): a streamed or background turn on a conversation
that exists sends no statement of its own to mark its run in progress, one round trip less
before its provider is called. Counted over the statements an app's pool sends
(tests/support/turn_kinds.py); `make bench` part 12 prints each kind's round trips."""

from __future__ import annotations

import pytest

from tests.support.events import background
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
