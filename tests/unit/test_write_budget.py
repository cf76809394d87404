"""OWNER_MAX_WRITE_BYTES_PER_MINUTE (service/usecases/owner_limits.py WriteBudget), on a clock the
test moves: what one owner's writes may store a minute through one replica."""

from __future__ import annotations

import contextlib

import pytest

from service.core.errors import TooManyRequests
from service.usecases.owner_limits import WriteBudget

MIB = 1024 * 1024


def budget(per_minute: int) -> tuple[WriteBudget, list[float]]:
    now = [0.0]
    return WriteBudget(per_minute, clock=lambda: now[0]), now


def test_writes_admitted_together_cannot_pass_the_budget_together() -> None:
    """Each admitted write takes what it brings at once: thirty forks of 64 MiB started
    together are not all admitted by a full bucket of 256 MiB (they were: 1.9 GiB)."""
    limit, _ = budget(256 * MIB)
    refused = 0
    with contextlib.ExitStack() as started:
        spends = []
        for _ in range(30):
            try:
                spends.append(started.enter_context(limit.spending("alice", 64 * MIB)))
            except TooManyRequests:
                refused += 1
        for spend in spends:  # each committed what it brought
            spend(64 * MIB)
    assert len(spends) == 4 and refused == 26
    with pytest.raises(TooManyRequests):
        limit.check("alice", 1)


def test_a_write_that_does_not_commit_gives_back_what_it_took() -> None:
    limit, _ = budget(10 * MIB)
    with pytest.raises(RuntimeError), limit.spending("alice", 8 * MIB):
        raise RuntimeError("the provider failed")
    with limit.spending("alice", 8 * MIB) as spend:  # all of it is there again
        spend(8 * MIB)
    with pytest.raises(TooManyRequests):
        limit.check("alice", 8 * MIB)


def test_what_was_stored_is_charged_and_the_bucket_refills_at_its_rate() -> None:
    limit, now = budget(6 * MIB)
    with limit.spending("alice", 1 * MIB) as spend:
        spend(12 * MIB)  # it stored more than it brought (a reply): in debt
    with pytest.raises(TooManyRequests) as refused:
        limit.check("alice", 1)
    assert refused.value.retry_after == "61"  # 6 MiB of debt and a byte, at 6 MiB a minute
    limit.check("bob", 6 * MIB)  # another owner is not touched
    now[0] += 61
    limit.check("alice", 1)
    now[0] += 600
    limit.check("alice", 6 * MIB)  # never fuller than the budget
    with pytest.raises(TooManyRequests):
        with limit.spending("alice", 6 * MIB) as spend:
            spend(6 * MIB)
        limit.check("alice", 1)


def test_a_write_larger_than_the_budget_is_admitted_by_a_full_bucket_alone() -> None:
    limit, _ = budget(1 * MIB)
    with limit.spending("alice", 5 * MIB) as spend:
        spend(5 * MIB)
    with pytest.raises(TooManyRequests):
        limit.check("alice", 1)


def test_no_budget_admits_everything() -> None:
    limit = WriteBudget(None)
    with limit.spending("alice", 10**12) as spend:
        spend(10**12)
    limit.check("alice", 10**12)
