"""What one owner may hold open at once on this replica (the contract's Limits): e.g. event
readers (OWNER_MAX_EVENT_READERS). Past the limit a new one is TooManyRequests (429 with
Retry-After), before anything starts. Limits counted across the fleet live in PostgreSQL."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from service.core.errors import TooManyRequests

RETRY_AFTER_S = "1"  # a reader's slot frees when one of the owner's streams ends


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
