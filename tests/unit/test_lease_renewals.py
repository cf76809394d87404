"""A renewal round of this process's turn leases (service/usecases/leases.py, ``_Keeper``)
reports a lease lost only when one was: not a lease a turn took while the renewal was on its
way (it was not in it), nor one whose commit gave it back meanwhile. Under load both happen
on every round, and each was logged as "turn leases were lost" (issue 44)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import msgspec
import pytest

from service.core.model import ANONYMOUS, Append, Turn
from service.core.plans import PlanRules, TurnPlan, chat_request, make_plan
from service.usecases.leases import LeasePolicy, Leases
from tests.support.memory import MemoryStore

LOST = "turn leases were lost"
TURN = Turn("hi", "hello", [msgspec.Raw(b'{"type":"message"}')])


class HeldRenewals(MemoryStore):
    """Each lease renewal waits, once sent, until the test lets it run (``go``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()
        self.go = asyncio.Event()

    async def renew_leases(
        self, leases: Sequence[tuple[uuid.UUID, uuid.UUID]], lease_s: float
    ) -> set[uuid.UUID]:
        self.sent.set()
        await self.go.wait()
        return await super().renew_leases(leases, lease_s)

    async def next_round(self) -> None:
        """The renewal on its way finished (its report logged): the next one was sent."""
        self.sent.clear()
        self.go.set()
        await self.sent.wait()


def plan(cid: uuid.UUID) -> TurnPlan:
    return make_plan(PlanRules(), chat_request(ANONYMOUS, "again", str(cid), None))


@pytest.mark.parametrize("meanwhile", ["taken", "committed", "lost"])
async def test_only_a_lease_taken_over_is_reported_lost(
    meanwhile: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = HeldRenewals()
    first, second = uuid.uuid4(), uuid.uuid4()
    for cid in (first, second):
        await store.append(Append(cid, TURN, 0))
    leases = Leases(store, store, store.notifications, LeasePolicy(lease_s=0.3))
    try:
        async with leases.hold(plan(first)) as held:
            await store.sent.wait()  # the renewal of the first turn's lease is on its way
            if meanwhile == "taken":  # another turn takes its conversation's lease meanwhile
                async with leases.hold(plan(second)):
                    await store.next_round()
            elif meanwhile == "committed":  # the turn commits meanwhile, then ends
                await leases.commit(Append(first, TURN, 1, lease=held.holder))
                held.committed = True
                await store.next_round()
            else:  # expired and taken over: gone from under the turn
                await store.release_lease(first, held.holder)
                await store.next_round()
    finally:
        await leases.close()
    reports = [r.getMessage() for r in caplog.records if LOST in r.getMessage()]
    if meanwhile == "lost":
        assert reports and reports[0] == f"1 {LOST} (expired and taken over)", reports
    else:
        assert reports == []
