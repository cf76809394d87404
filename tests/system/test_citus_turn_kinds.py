"""Every kind of turn on Citus runs on the worker of its conversation (deploy/SCALE-OUT.md):
served by a replica against the local cluster (tests/support/citus.py), each kind, held by its
provider long enough that its lease, its place, its heartbeat and its key are renewed while it
runs, makes no two-phase commit (a statement that touched every shard, or a transaction that
wrote on two workers, would make one on each), with an Idempotency-Key too (its key is the
coordinator's: issue 44). The counts come from the coordinator
(tests/support/turn_kinds.py); test_scale_out.py shows they see a write on both workers."""

from __future__ import annotations

import pytest

from tests.support.turn_kinds import measure_all

pytestmark = pytest.mark.citus


async def test_no_kind_of_turn_makes_a_two_phase_commit(database: str) -> None:
    costs = await measure_all(database)
    report = "\n".join(f"{name:40} {cost}" for name, cost in costs.items())
    assert all(cost.renewals > 0 for cost in costs.values()), report  # each was a long turn
    kinds = {name: cost.two_phase for name, cost in costs.items()}
    assert kinds == dict.fromkeys(kinds, 0), report
    assert sum("Idempotency-Key" in name for name in kinds) == 3, report
