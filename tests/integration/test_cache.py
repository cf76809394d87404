"""The replica-local history cache against real PostgreSQL: what it reads, what it keeps, and
that nobody can tell it is there."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from uuid import UUID

import msgspec
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import build_services
from service.core.errors import ConversationConflict, ConversationNotFound, PreconditionFailed
from service.core.model import (
    ANONYMOUS,
    Append,
    Conversation,
    LeaseAttempt,
    LeaseRequest,
    Removal,
    Turn,
)
from service.platform.db import create_engine
from service.platform.settings import Settings
from service.store.cache import CachedStore, turn_size
from service.store.postgres import Adapter, PostgresStore
from service.store.postgres.history import PostgresHistory
from tests.conftest import ClientFactory
from tests.support.helpers import CHAT

MiB = 1024 * 1024


class CountingStore(PostgresHistory):
    """PostgreSQL's History that records every load: (after_revision, turn rows returned)."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(Adapter(engine))
        self.reads: list[tuple[int, int]] = []

    async def load(
        self, conversation_id: UUID, owner: str = ANONYMOUS, *, after_revision: int = 0
    ) -> Conversation | None:
        conversation = await super().load(conversation_id, owner, after_revision=after_revision)
        self.reads.append((after_revision, len(conversation.turns) if conversation else 0))
        return conversation

    async def lease(self, ask: LeaseRequest) -> LeaseAttempt:
        attempt = await super().lease(ask)
        found = attempt.conversation
        self.reads.append((ask.after_revision, len(found.turns) if found else 0))
        return attempt


def make_turn(n: int, *, size: int = 100) -> Turn:
    reasoning = {"type": "reasoning", "id": f"rs_{n}", "encrypted_content": "x" * size}
    items = [
        msgspec.Raw(msgspec.json.encode({"n": n})),
        msgspec.Raw(msgspec.json.encode(reasoning)),
    ]
    return Turn(f"question {n}", f"answer {n}", items)


async def grow(store: CachedStore | PostgresHistory, cid: UUID, turns: int, start: int = 0) -> None:
    for n in range(start, start + turns):
        await store.append(Append(cid, make_turn(n), n))


@pytest.fixture
def counting(engine: AsyncEngine) -> CountingStore:
    return CountingStore(engine)


@pytest.fixture
async def other_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """A second pool on the same database: another replica."""
    engine = create_engine(database_url, pool_size=2)
    yield engine
    await engine.dispose()


async def test_a_current_cache_reads_no_turn_rows(
    counting: CountingStore, store: PostgresStore
) -> None:
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(cache, cid, 3)
    assert cache.cached_revision(cid) == 3  # appends extended the cache, nothing was read

    loaded = await cache.load(cid)
    again = await cache.load(cid)

    assert counting.reads == [(3, 0), (3, 0)]
    assert loaded == again == await store.history.load(cid)
    assert loaded is not None and loaded.revision == 3 and len(loaded.turns) == 3


async def test_cached_items_are_reused_as_they_are(counting: CountingStore) -> None:
    """The replay items are the same objects turn after turn: decoded once, when read, and
    spliced by msgspec into the provider request without being encoded again."""
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(counting, cid, 2)
    first = await cache.load(cid)
    second = await cache.load(cid)
    assert first is not None and second is not None
    assert all(a is b for a, b in zip(first.turns, second.turns, strict=True))
    items = second.replay_items
    assert msgspec.json.encode(items) == b"[" + b",".join(bytes(i) for i in items) + b"]"


async def test_a_cold_cache_reads_everything_once(
    counting: CountingStore, store: PostgresStore
) -> None:
    cid = uuid.uuid4()
    await grow(store.history, cid, 4)
    cache = CachedStore(counting, MiB)

    assert await cache.load(cid) == await store.history.load(cid)
    await cache.load(cid)

    assert counting.reads == [(0, 4), (4, 0)]


async def test_another_replicas_commits_are_read_as_a_few_rows(
    counting: CountingStore, store: PostgresStore, other_engine: AsyncEngine
) -> None:
    here = CachedStore(counting, MiB)
    there = CachedStore(PostgresHistory(Adapter(other_engine)), MiB)
    cid = uuid.uuid4()
    await grow(here, cid, 3)
    await grow(there, cid, 2, start=3)  # revisions 4 and 5, committed elsewhere

    loaded = await here.load(cid)

    assert counting.reads == [(3, 2)]
    assert loaded == await store.history.load(cid)
    assert loaded is not None and [t.user_message for t in loaded.turns] == [
        f"question {n}" for n in range(5)
    ]


async def test_two_replicas_interleaving_stay_correct(
    engine: AsyncEngine, other_engine: AsyncEngine, store: PostgresStore
) -> None:
    """Two cached replicas take turns at random on a few conversations, each turn as the use
    case does it (load, then append at the loaded revision); every load equals the truth."""
    replicas = [
        CachedStore(PostgresHistory(Adapter(engine)), MiB),
        CachedStore(PostgresHistory(Adapter(other_engine)), MiB),
    ]
    conversations = [uuid.uuid4() for _ in range(3)]
    revisions = dict.fromkeys(conversations, 0)
    rng = random.Random(7)
    for step in range(60):
        replica, cid = rng.choice(replicas), rng.choice(conversations)
        loaded = await replica.load(cid)
        assert loaded == await store.history.load(cid)
        expected = loaded.revision if loaded else 0
        assert expected == revisions[cid]
        commit = await replica.append(Append(cid, make_turn(step), expected))
        revisions[cid] = commit.revision
    for replica in replicas:
        for cid in conversations:
            assert await replica.load(cid) == await store.history.load(cid)


async def test_a_turn_reads_and_caches_its_window_not_the_history(
    counting: CountingStore, store: PostgresStore, other_engine: AsyncEngine
) -> None:
    """Through the cache a turn's lease holds the turns from the committed window start on;
    when another replica moves the window on, one read of the newer rows revalidates it and
    the turns now before the window are dropped."""
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    for n, start in enumerate([1, 1, 3, 3], 1):
        await store.history.append(Append(cid, replace(make_turn(n), context_from=start), n - 1))

    async def turn_reads() -> list[str]:
        holder = uuid.uuid4()
        attempt = await cache.lease(LeaseRequest(cid, ANONYMOUS, holder, lease_s=30, queue=False))
        await store.places.release_lease(cid, holder)  # (the cache passes leases by)
        found = attempt.conversation
        assert attempt.acquired and found is not None
        assert found.complete and found.first == found.context_start
        return [turn.user_message for turn in found.turns]

    assert await turn_reads() == ["question 3", "question 4"]
    one = turn_size(make_turn(0))  # every turn here is the same size
    assert cache.cached_revision(cid) == 4 and cache.cached_bytes == 2 * one
    there = CachedStore(PostgresHistory(Adapter(other_engine)), MiB)
    await there.append(Append(cid, replace(make_turn(5), context_from=4), 4))

    assert await turn_reads() == ["question 4", "question 5"]
    assert counting.reads == [(0, 2), (4, 1)]
    assert cache.cached_revision(cid) == 5 and cache.cached_bytes == 2 * one


async def test_a_conflict_evicts_and_the_next_load_reads_afresh(
    counting: CountingStore, store: PostgresStore, other_engine: AsyncEngine
) -> None:
    here = CachedStore(counting, MiB)
    there = CachedStore(PostgresHistory(Adapter(other_engine)), MiB)
    cid = uuid.uuid4()
    await grow(here, cid, 2)
    await there.load(cid)
    await there.append(Append(cid, make_turn(2), 2))

    with pytest.raises(ConversationConflict):
        await here.append(Append(cid, make_turn(99), 2))  # stale: revision 3 exists

    assert here.cached_revision(cid) is None
    assert await here.load(cid) == await store.history.load(cid)
    assert counting.reads == [(0, 3)]


async def test_not_found_on_append_evicts(
    counting: CountingStore, other_engine: AsyncEngine
) -> None:
    here = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(here, cid, 2)
    await PostgresStore.over(other_engine).history.delete(
        Removal(cid)
    )  # deleted by another replica

    with pytest.raises(ConversationNotFound):
        await here.append(Append(cid, make_turn(2), 2))

    assert here.cached_revision(cid) is None
    assert await here.load(cid) is None


async def test_delete_evicts(counting: CountingStore) -> None:
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(cache, cid, 2)
    assert cache.cached_bytes > 0

    await cache.delete(Removal(cid))

    assert cache.cached_revision(cid) is None and cache.cached_bytes == 0
    assert await cache.load(cid) is None


async def test_a_failed_delete_evicts_and_keeps_the_conversation(
    counting: CountingStore, store: PostgresStore
) -> None:
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(cache, cid, 2)

    with pytest.raises(PreconditionFailed):
        await cache.delete(Removal(cid), if_match=frozenset({1}))

    assert cache.cached_revision(cid) is None
    assert await cache.load(cid) == await store.history.load(cid)


async def test_a_deleted_conversation_found_by_another_replica_is_gone(
    counting: CountingStore, other_engine: AsyncEngine
) -> None:
    here = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(here, cid, 2)
    await CachedStore(PostgresHistory(Adapter(other_engine)), MiB).delete(Removal(cid))

    assert await here.load(cid) is None
    assert here.cached_revision(cid) is None


async def test_an_id_reused_by_a_new_conversation_is_not_mixed_up(
    counting: CountingStore, store: PostgresStore
) -> None:
    """If an id ever named a new conversation, cached turns of the old one must not leak in
    (its created_at differs), even when the new one has as many turns."""
    cache = CachedStore(counting, MiB)
    cid = uuid.uuid4()
    await grow(cache, cid, 2)
    await store.history.delete(Removal(cid))
    for n in range(3):
        await store.history.append(Append(cid, make_turn(100 + n), n))

    loaded = await cache.load(cid)

    assert loaded == await store.history.load(cid)
    assert loaded is not None and loaded.turns[0].user_message == "question 100"
    assert counting.reads == [(2, 1), (0, 3)]


async def test_lru_eviction_by_bytes(counting: CountingStore) -> None:
    a, b, c = (uuid.uuid4() for _ in range(3))
    for cid in (a, b, c):
        await grow(counting, cid, 2)
    one = 2 * turn_size(make_turn(0))  # one conversation's bytes (every turn is the same size)
    cache = CachedStore(counting, 2 * one + one // 2)  # room for two conversations
    await cache.load(a)
    await cache.load(b)
    await cache.load(a)  # a is now the most recently used

    await cache.load(c)  # makes room by dropping b

    assert cache.cached_revision(a) == 2 and cache.cached_revision(c) == 2
    assert cache.cached_revision(b) is None
    assert cache.cached_bytes == 2 * one
    counting.reads.clear()
    await cache.load(b)
    assert counting.reads == [(0, 2)]  # read whole again


async def test_a_conversation_larger_than_the_cache_is_not_kept(
    counting: CountingStore, store: PostgresStore
) -> None:
    cid = uuid.uuid4()
    await grow(counting, cid, 3)
    cache = CachedStore(counting, turn_size(make_turn(0)))

    assert await cache.load(cid) == await store.history.load(cid)
    assert cache.cached_revision(cid) is None and cache.cached_bytes == 0


async def test_a_disabled_cache_passes_everything_through(
    counting: CountingStore, store: PostgresStore
) -> None:
    cache = CachedStore(counting, 0)
    cid = uuid.uuid4()
    await grow(cache, cid, 2)

    assert await cache.load(cid) == await store.history.load(cid)
    assert await cache.load(cid) == await store.history.load(cid)

    assert counting.reads == [(0, 2), (0, 2)]
    assert cache.cached_bytes == 0


def test_the_setting() -> None:
    assert Settings.from_env({}).history_cache_bytes == 64 * MiB
    assert Settings.from_env({"HISTORY_CACHE_BYTES": "0"}).history_cache_bytes == 0
    assert Settings.from_env({"HISTORY_CACHE_BYTES": "1024"}).history_cache_bytes == 1024


@pytest.mark.parametrize(("cache_bytes", "cached"), [(1024, True), (0, False)])
def test_the_app_wraps_its_store_unless_switched_off(
    database_url: str, cache_bytes: int, cached: bool
) -> None:
    services = build_services(Settings(database_url=database_url, history_cache_bytes=cache_bytes))
    try:
        assert isinstance(services.history, CachedStore) is cached
    finally:
        asyncio.run(services.close())


async def test_clients_cannot_tell_the_cache_is_there(make_client: ClientFactory) -> None:
    """Turns alternate between a cached and an uncached replica on one database; every reply
    (the fake provider counts the history it was sent and checks every sealed item) and every
    read of the conversation is the same whichever replica answers."""
    async with (
        make_client() as cached,
        make_client(history_cache_bytes=0) as uncached,
    ):
        first = await cached.post(CHAT, json={"message": "hello"})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        replies = [first.json()["message"]]
        for n, client in enumerate([cached, cached, uncached, cached, uncached, uncached, cached]):
            response = await client.post(CHAT, json={"message": f"m{n}", "conversation_id": cid})
            assert response.status_code == 200, response.text
            replies.append(response.json()["message"])
            views = [
                (await c.get(f"/api/v1/conversations/{cid}")).json() for c in (cached, uncached)
            ]
            assert views[0] == views[1]
            assert views[0]["revision"] == n + 2
        assert replies == ["[fake-llm] hello"] + [
            f"[fake-llm] m{n} (history={2 * (n + 1)})" for n in range(7)
        ]
        assert (await cached.delete(f"/api/v1/conversations/{cid}")).status_code == 204
        for client in (cached, uncached):
            assert (await client.get(f"/api/v1/conversations/{cid}")).status_code == 404
