"""What one owner may do on this replica (the contract's Limits): hold open at once, e.g. event
readers (OWNER_MAX_EVENT_READERS) and turns queued for a conversation
(OWNER_MAX_QUEUED_TURNS), and write a minute (OWNER_MAX_WRITE_BYTES_PER_MINUTE). Past a limit
a new one is TooManyRequests (429 with Retry-After), before anything starts. Limits counted
across the fleet live in PostgreSQL."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from service.core.errors import TooManyRequests

RETRY_AFTER_S = "1"  # a reader's slot frees when one of the owner's streams ends
MAX_TRACKED = 10_000  # owners with a bucket not full, before those refilled are dropped
SWEEP_S = 10.0  # ... at most this often


class OwnerLimit:
    """At most ``limit`` of one kind of work per owner in this process."""

    def __init__(self, limit: int, what: str) -> None:
        self._limit, self._what = limit, what
        self._open: Counter[str] = Counter()

    def take(self, owner: str) -> Callable[[], None]:
        """A slot for ``owner``, or TooManyRequests; call what it returns to give it back
        (once: more calls do nothing)."""
        if self._open[owner] >= self._limit:
            raise TooManyRequests(
                f"At most {self._limit} {self._what} per owner at once on this server.",
                retry_after=RETRY_AFTER_S,
            )
        self._open[owner] += 1
        held = [True]

        def release() -> None:
            if held.pop() if held else False:
                self._open[owner] -= 1
                if not self._open[owner]:
                    del self._open[owner]

        return release

    def open(self, owner: str) -> int:
        return self._open[owner]


class WriteBudget:
    """OWNER_MAX_WRITE_BYTES_PER_MINUTE on this replica: what one owner's writes may store, a
    bucket of ``per_minute`` bytes refilled at ``per_minute`` a minute. A write is admitted
    (before any provider call) while the bucket holds what it brings, or is full, and what it
    brings is taken from the bucket at once (so writes admitted together cannot pass it
    together); once it commits, what it stored is charged instead, which may leave the bucket
    in debt until it refills, and a write that does not commit gives back what it took. So in
    any minute one owner's writes through one replica store at most twice the budget and one
    write more (a full bucket, a minute's refill, and the write that emptied it). None: no
    budget."""

    def __init__(self, per_minute: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # owner -> (bytes left, when)
        self._swept_at = clock()

    def check(self, owner: str, adding: int) -> None:
        """TooManyRequests unless ``owner`` may write ``adding`` bytes now (nothing taken)."""
        if self.per_minute is None:
            return
        left = self._left(owner)
        wanted = min(adding, self.per_minute)
        if left >= wanted:
            return
        wait_s = (wanted - left) * 60 / self.per_minute
        raise TooManyRequests(
            f"This owner's writes passed {self.per_minute} bytes a minute on this server "
            "(OWNER_MAX_WRITE_BYTES_PER_MINUTE); nothing was kept. Retry after a while.",
            retry_after=str(max(1, math.ceil(wait_s))),
        )

    @contextmanager
    def spending(self, owner: str, adding: int) -> Iterator[Callable[[int], None]]:
        """A write of ``owner`` bringing ``adding`` bytes, admitted (else TooManyRequests) and
        taken from the bucket for the time inside; call what it yields with what the write
        stored once it committed. Left without that call, the write gives it all back."""
        self.check(owner, adding)
        spent: list[int] = []
        self._take(owner, adding)
        try:
            yield spent.append
        finally:
            self._take(owner, (spent[-1] if spent else 0) - adding)

    def _take(self, owner: str, size: int) -> None:
        if self.per_minute is None or not size:
            return
        self._level[owner] = (self._left(owner) - size, self._clock())
        now = self._clock()
        if len(self._level) > MAX_TRACKED and now - self._swept_at > SWEEP_S:
            self._swept_at = now
            self._forget_full()

    def _left(self, owner: str) -> float:
        assert self.per_minute is not None
        level = self._level.get(owner)
        if level is None:
            return float(self.per_minute)
        left, when = level
        return min(float(self.per_minute), left + (self._clock() - when) * self.per_minute / 60)

    def _forget_full(self) -> None:
        """Owners whose buckets have refilled need no entry (looked for once a while)."""
        assert self.per_minute is not None
        self._level = {o: v for o, v in self._level.items() if self._left(o) < self.per_minute}
