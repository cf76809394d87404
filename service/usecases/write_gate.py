"""The write gate: what every write of either surface passes through, whatever its route.

A write here is anything that stores something a client asked for: a turn (plain, streamed,
background, /v1), a compaction, a fork, an item append or removal, a conversation made or
deleted, its metadata, a response forgotten. Each asks the gate for two things, in order:

1. ``claim``: its Idempotency-Key, if it came with one. The first attempt claims it in
   PostgreSQL (so the same key on two replicas at once commits once); a retry gets where the
   first attempt committed (``Committed``: the route answers it again, without writing), or
   RequestInProgress while it runs, or IdempotencyKeyReused for another request. The claim is
   held for TURN_LEASE_S and renewed while the write runs (a replica that dies frees its keys
   within that), completed by the write's own transaction (the store's), and freed at once by
   a write that does not commit (``release``).
2. ``admit``: the bytes it will write, against the owner's write budget
   (OWNER_MAX_WRITE_BYTES_PER_MINUTE), before any provider call; what it stored is
   ``charge``d once it committed.

The rest of the promises live where no write can go around them: the shred's refusal and
the revision inside the commit statement (store/postgres), the size a conversation holds
counted over every column a write stores (core/sizes.py), every database failure mapped once
(store/postgres/tx.py). ``tests/integration/test_promises.py`` holds every writing route of
the OpenAPI document to all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from service.core.errors import InvalidInput, RequestInProgress, StorageError
from service.core.model import Committed, IdempotencyKey
from service.store.ports import IdempotencyStore
from service.usecases.heartbeat import Heartbeat
from service.usecases.locks import settle
from service.usecases.owner_limits import WriteBudget

log = logging.getLogger("turnstore.gate")

T = TypeVar("T")


class WriteGate:
    def __init__(
        self,
        keys: IdempotencyStore | None,
        *,
        lease_s: float = 30.0,
        budget: WriteBudget | None = None,
    ) -> None:
        self._keys = keys
        self._lease_s = lease_s
        self.budget = budget or WriteBudget(None)
        self._held: dict[uuid.UUID, IdempotencyKey] = {}  # claims renewed while held
        self._heartbeat = Heartbeat(lease_s / 3, self._renew, lambda: bool(self._held))

    @property
    def serves_keys(self) -> bool:
        """Whether Idempotency-Key is served (its claims are stored somewhere)."""
        return self._keys is not None

    def key(self, owner: str, value: str | None, *subject: str | bytes) -> IdempotencyKey | None:
        """The key a request came with (None: none), bound to what it asks (``subject``: its
        route and everything of it a retry must repeat)."""
        if value is None:
            return None
        if self._keys is None:
            raise InvalidInput("Idempotency-Key is not enabled on this server.")
        return IdempotencyKey.of(owner, value, *subject)

    # --- Idempotency-Keys ---------------------------------------------------------------------

    async def claim(
        self, key: IdempotencyKey | None, turn_id: uuid.UUID | None = None
    ) -> Committed | None:
        """Claim ``key`` for this attempt (``turn_id``: the run it starts), renewed from now on
        until ``settled`` or ``release``; where an earlier attempt committed, if one did.
        Raises RequestInProgress, IdempotencyKeyReused."""
        if key is None or self._keys is None:
            return None
        committed = await self._keys.claim(key, turn_id)
        if committed is None:
            self._held[key.claim] = key
            self._heartbeat.start()
        return committed

    async def check(self, key: IdempotencyKey | None) -> None:
        """Raise now what ``claim`` would (a stream reports it as JSON before it starts), but
        not for the retry of a run (it follows the run)."""
        if key is None or self._keys is None:
            return
        try:
            await self._keys.check(key)
        except RequestInProgress as running:
            if running.turn_id is None:
                raise

    def settled(self, key: IdempotencyKey | None) -> None:
        """The write committed, and its transaction completed the key: no more renewals."""
        if key is not None:
            self._held.pop(key.claim, None)

    async def release(self, key: IdempotencyKey | None, *, in_doubt: bool = True) -> None:
        """A write that did not commit does not use its key up. ``in_doubt``: it may have
        committed all the same (``doubtful``; IdempotencyStore.release)."""
        if key is None or self._keys is None:
            return
        self._held.pop(key.claim, None)
        with contextlib.suppress(StorageError):  # the claim runs out by itself anyway
            await settle(self._keys.release(key, in_doubt=in_doubt))

    async def release_run(self, turn_id: uuid.UUID, owner: str) -> None:
        """A run that ended without its commit (its replica vanished) frees its key."""
        if self._keys is not None:
            with contextlib.suppress(StorageError):
                await settle(self._keys.release_run(turn_id, owner))

    async def once(
        self,
        key: IdempotencyKey | None,
        write: Callable[[], Awaitable[T]],
        replay: Callable[[Committed], Awaitable[T]],
    ) -> T:
        """``write`` (which hands ``key`` to the store, completed in its transaction), run once
        per key: a retry gets ``replay`` of where the first attempt committed."""
        committed = await self.claim(key)
        if committed is not None:
            return await replay(committed)
        try:
            done = await write()
        except BaseException as failure:
            await self.release(key, in_doubt=doubtful(failure))
            raise
        self.settled(key)
        return done

    async def close(self) -> None:
        await self._heartbeat.close()

    async def _renew(self) -> None:
        held = list(self._held.values())
        if not held or self._keys is None:
            return
        try:
            await self._keys.renew(held, self._lease_s)
        except StorageError:
            log.warning("could not renew %d Idempotency-Key claims", len(held))


def doubtful(failure: BaseException) -> bool:
    """Whether a write that ended with ``failure`` may have committed all the same: a storage
    failure (its commit may have been cut off after the database took it) or a cancellation
    (a reader gone: GeneratorExit) may come while it commits; anything else (the provider's
    answer, a refusal, a conflict) ends it before or without its commit."""
    return isinstance(failure, StorageError | asyncio.CancelledError | GeneratorExit)
