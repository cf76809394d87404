"""The store contract: conditional append, delete, owners, listing and Idempotency-Key claims,
and each owner's places among the running turns. Not collected by itself: each module that
imports it (``from tests.contracts.store import *``) runs it over the backends it names in
``BACKENDS`` (tests/conftest.py parametrizes the fixtures below with them): the in-memory fake
in tests/unit/test_store.py, PostgreSQL in clear and encrypted in tests/integration/test_store.py,
Citus in tests/system/test_citus.py. Races of real transactions are PostgreSQL's alone
(tests/integration/test_store.py)."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.core.errors import (
    ConversationConflict,
    ConversationNotFound,
    IdempotencyKeyReused,
    InvalidInput,
    PreconditionFailed,
    RequestInProgress,
)
from service.core.export_lines import Imported
from service.core.model import (
    ANONYMOUS,
    Append,
    Committed,
    Conversation,
    ConversationInfo,
    IdempotencyKey,
    LeaseRequest,
    Origin,
    Removal,
    Turn,
)
from service.core.search import Finding
from service.core.sizes import turn_bytes
from service.core.usage import Usage
from service.store.postgres import PostgresStore, StoreConfig
from service.usecases.paging import held_bytes
from tests.support.backends import keyring_for
from tests.support.memory import MemoryStore

AnyStore = PostgresStore | MemoryStore


@pytest.fixture
def contract_store(request: pytest.FixtureRequest) -> AnyStore:
    """The store of the backend ``request.param`` (one of the importing module's BACKENDS)."""
    if request.param == "memory":
        return MemoryStore()
    engine = request.getfixturevalue("engine")
    return PostgresStore.over(engine, keyring=keyring_for(engine, request.param))


async def stored_turns(store: AnyStore) -> int:
    """Turn rows the store holds, whatever conversation they belong to."""
    if isinstance(store, MemoryStore):
        return sum(len(c.turns) for c in store._conversations.values())
    return await count(store.db.engine, "turns")


def turn(n: int) -> Turn:
    items = [
        msgspec.Raw(b'{"type":"message","role":"user","content":"u%d"}' % n),
        # Key order, spacing and escapes must survive: the provider's bytes, not a re-encoding.
        msgspec.Raw(
            b'{"type":"reasoning","summary":[],"encrypted_content":"gA\\u00e9%d==" , "id":"rs"}' % n
        ),
    ]
    return Turn(f"user {n} \N{SNOWMAN}", f"assistant {n}", items)


async def count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text(f"SELECT count(*) FROM {table}")) or 0)


async def test_unknown_conversation_loads_as_none(contract_store: AnyStore) -> None:
    assert await contract_store.history.load(uuid.uuid4()) is None


async def test_appends_turns_in_order_and_keeps_replay_bytes(contract_store: AnyStore) -> None:
    store = contract_store
    cid = uuid.uuid4()
    for n in range(1, 4):
        commit = await store.history.append(Append(cid, turn(n), n - 1))
        assert commit.revision == n
    loaded = await store.history.load(cid)
    assert loaded is not None
    assert loaded.revision == 3
    assert [t.user_message for t in loaded.turns] == [turn(n).user_message for n in (1, 2, 3)]
    expected = [bytes(item) for n in (1, 2, 3) for item in turn(n).replay_items]
    assert [bytes(item) for item in loaded.replay_items] == expected


async def test_stale_expected_revision_conflicts_and_writes_nothing(
    contract_store: AnyStore,
) -> None:
    store = contract_store
    cid = uuid.uuid4()
    await store.history.append(Append(cid, turn(1), 0))
    await store.history.append(Append(cid, turn(2), 1))
    with pytest.raises(ConversationConflict):
        await store.history.append(Append(cid, turn(3), 1))
    with pytest.raises(ConversationConflict):
        await store.history.append(Append(cid, turn(3), 0))  # "new" conversation whose id exists
    loaded = await store.history.load(cid)
    assert loaded is not None and loaded.revision == 2
    assert await stored_turns(store) == 2


async def test_append_to_deleted_conversation_is_not_found(contract_store: AnyStore) -> None:
    store = contract_store
    cid = uuid.uuid4()
    await store.history.append(Append(cid, turn(1), 0))
    await store.history.delete(Removal(cid))
    with pytest.raises(ConversationNotFound):
        await store.history.append(Append(cid, turn(2), 1))


async def test_delete_removes_transcript_and_replay_items(contract_store: AnyStore) -> None:
    store = contract_store
    keep, gone = uuid.uuid4(), uuid.uuid4()
    for cid in (keep, gone):
        await store.history.append(Append(cid, turn(1), 0))
        await store.history.append(Append(cid, turn(2), 1))
    await store.history.delete(Removal(gone))
    assert await store.history.load(gone) is None
    assert await stored_turns(store) == 2
    with pytest.raises(ConversationNotFound):
        await store.history.delete(Removal(gone))
    loaded = await store.history.load(keep)
    assert loaded is not None and loaded.revision == 2


async def test_delete_honours_if_match(contract_store: AnyStore) -> None:
    store = contract_store
    cid = uuid.uuid4()
    await store.history.append(Append(cid, turn(1), 0))
    with pytest.raises(PreconditionFailed):
        await store.history.delete(Removal(cid), if_match=frozenset({2}))
    assert await store.history.load(cid) is not None
    await store.history.delete(Removal(cid), if_match=frozenset({1}))
    assert await store.history.load(cid) is None


# --- owners, listing, Idempotency-Key records: the same contract for both stores ----------


async def test_another_owners_conversation_is_never_returned(contract_store: AnyStore) -> None:
    store, cid = contract_store, uuid.uuid4()
    await store.history.append(Append(cid, turn(1), 0, owner="alice"))
    assert await store.history.load(cid, "bob") is None
    assert await store.history.load(cid) is None  # nor the anonymous owner's
    with pytest.raises(ConversationNotFound):
        await store.history.append(Append(cid, turn(2), 1, owner="bob"))
    with pytest.raises(ConversationNotFound):
        await store.history.delete(Removal(cid, "bob"))
    loaded = await store.history.load(cid, "alice")
    assert loaded is not None and loaded.owner == "alice" and loaded.revision == 1


async def test_load_after_a_revision_returns_only_newer_turns(contract_store: AnyStore) -> None:
    store, cid = contract_store, uuid.uuid4()
    for n in range(1, 4):
        await store.history.append(Append(cid, turn(n), n - 1))
    newer = await store.history.load(cid, after_revision=2)
    assert newer is not None and newer.revision == 3
    assert [t.user_message for t in newer.turns] == [turn(3).user_message]
    current = await store.history.load(cid, after_revision=3)
    assert current is not None and current.turns == [] and current.revision == 3


async def test_a_turn_loads_its_window_from_the_committed_window_start_not_the_history(
    contract_store: AnyStore,
) -> None:
    """The lease (a turn's load) reads the turns from context_start on, also after a cached
    revision before it; a whole read (load) still has them all."""
    store, cid = contract_store, uuid.uuid4()
    starts = [1, 1, 2, 4, 4, 6]  # each turn's window start: context_start ends at 6
    for n, start in enumerate(starts, 1):
        await store.history.append(Append(cid, replace(turn(n), context_from=start), n - 1))

    async def leased(after: int) -> Conversation:
        ask = LeaseRequest(cid, ANONYMOUS, uuid.uuid4(), lease_s=30, queue=False)
        attempt = await store.history.lease(replace(ask, after_revision=after))
        assert attempt.conversation is not None
        await store.places.release_lease(cid, ask.holder)
        return attempt.conversation

    for after, first in ((0, 6), (3, 6), (5, 6), (6, 7)):
        window = await leased(after)
        assert (window.revision, window.context_start, window.first) == (6, 6, first)
        assert [t.user_message for t in window.turns] == [
            turn(n).user_message for n in range(first, 7)
        ]
        assert window.complete
    whole = await store.history.load(cid)
    assert whole is not None and whole.first == 1 and len(whole.turns) == 6


async def test_listing_pages_newest_first_and_refuses_foreign_cursors(
    contract_store: AnyStore,
) -> None:
    store = contract_store
    ids = [uuid.uuid4() for _ in range(3)]
    for cid in ids:
        await store.history.append(Append(cid, turn(1), 0, owner="carol"))
    await store.history.append(Append(uuid.uuid4(), turn(1), 0, owner="dave"))
    first, cursor = await store.reads.list_conversations("carol", 2)
    second, end = await store.reads.list_conversations("carol", 2, cursor)
    assert [s.id for s in first + second] == ids[::-1] and end is None
    # The second: year 9999 at -14:00 (past the largest UTC instant) with a valid id.
    far = "OTk5OS0xMi0zMVQyMzo1OTo1OS0xNDowMHwwMDAwMDAwMC0wMDAwLTAwMDAtMDAwMC0wMDAwMDAwMDAwMDE"
    for crafted in ("garbage!", far):
        with pytest.raises(InvalidInput):
            await store.reads.list_conversations("carol", 2, crafted)


def key(name: str = "k", asked: str = "h1", owner: str = ANONYMOUS) -> IdempotencyKey:
    return IdempotencyKey(owner, name, asked)


async def test_an_idempotency_key_is_claimed_once_and_names_its_commit(
    contract_store: AnyStore,
) -> None:
    store, cid, first = contract_store, uuid.uuid4(), key()
    assert await store.idempotency.claim(first) is None
    with pytest.raises(RequestInProgress):
        await store.idempotency.claim(key())
    with pytest.raises(RequestInProgress):
        await store.idempotency.check(key())
    with pytest.raises(IdempotencyKeyReused):
        await store.idempotency.claim(key(asked="h2"))
    with pytest.raises(RequestInProgress):  # another attempt: only the one that claimed it
        await store.history.append(Append(cid, turn(1), 0, idempotency=key()))
    commit = await store.history.append(Append(cid, turn(1), 0, idempotency=first))
    assert await store.idempotency.claim(key()) == Committed(cid, commit.revision)
    await store.idempotency.check(key())  # done: nothing to raise
    assert await store.idempotency.claim(key(owner="eve")) is None  # keys are per owner


async def test_a_released_key_can_be_claimed_again(contract_store: AnyStore) -> None:
    store, claimed = contract_store, key("r")
    assert await store.idempotency.claim(claimed) is None
    await store.idempotency.release(key("r"))  # another attempt's release: the claim stays
    with pytest.raises(RequestInProgress):
        await store.idempotency.claim(key("r"))
    await store.idempotency.release(claimed)
    assert await store.idempotency.claim(key("r", asked="other")) is None


async def test_an_attempt_whose_claim_ran_out_and_was_taken_over_writes_nothing(
    contract_store: AnyStore,
) -> None:
    """A claim is held by one attempt: once its lease ran out (its replica stopped renewing
    it, a database outage) and another attempt took it over, the first attempt's commit
    writes nothing, and its release frees nothing (two commits of one key were possible)."""
    store, cid, other = contract_store, uuid.uuid4(), uuid.uuid4()
    first = key("taken over")
    assert await store.idempotency.claim(first) is None
    await expire_claims(store)
    second = key("taken over")
    assert await store.idempotency.claim(second) is None  # taken over
    with pytest.raises(RequestInProgress):
        await store.history.append(Append(cid, turn(1), 0, idempotency=first))
    with pytest.raises(RequestInProgress):
        await store.edits.create_conversation(ANONYMOUS, {}, turn(1), first)
    await store.idempotency.release(first)
    with pytest.raises(RequestInProgress):  # the second attempt still holds it
        await store.idempotency.claim(key("taken over"))
    commit = await store.history.append(Append(other, turn(1), 0, idempotency=second))
    assert await store.idempotency.claim(key("taken over")) == Committed(other, commit.revision)
    assert await store.reads.describe(cid, ANONYMOUS) is None  # the first attempt wrote nothing


async def expire_claims(store: AnyStore) -> None:
    """Every running claim's lease ran out (as when its replica stops renewing it)."""
    if isinstance(store, PostgresStore):
        async with store.db.engine.begin() as conn:
            await conn.execute(
                text("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
            )
    else:
        for found in store._keys.values():
            found.expires_at = found.expires_at - timedelta(days=1)


async def test_deleting_a_conversation_forgets_the_keys_that_committed_to_it(
    contract_store: AnyStore,
) -> None:
    store, cid, gone = contract_store, uuid.uuid4(), key("gone")
    assert await store.idempotency.claim(gone) is None
    await store.history.append(Append(cid, turn(1), 0, idempotency=gone))
    await store.history.delete(Removal(cid))
    assert await store.idempotency.claim(key("gone", asked="anything")) is None  # no record left


async def test_a_fork_holds_the_first_turns_as_they_are_and_goes_its_own_way(
    contract_store: AnyStore,
) -> None:
    store, source = contract_store, uuid.uuid4()
    for n in range(1, 4):
        await store.history.append(Append(source, turn(n), n - 1, owner="alice"))
    fork = await store.edits.fork(source, "alice", 2)
    assert fork.revision == 2 and fork.id != source
    forked = await store.history.load(fork.id, "alice")
    assert forked is not None and forked.revision == 2
    expected = [bytes(item) for n in (1, 2) for item in turn(n).replay_items]
    assert [bytes(item) for item in forked.replay_items] == expected
    await store.history.append(Append(fork.id, turn(9), 2, owner="alice"))
    await store.history.append(Append(source, turn(4), 3, owner="alice"))
    again = await store.history.load(source, "alice")
    assert again is not None and [t.user_message for t in again.turns][-1] == turn(4).user_message
    await store.history.delete(Removal(source, "alice"))
    kept = await store.history.load(fork.id, "alice")
    assert kept is not None and kept.revision == 3  # deleting one never touches the other
    with pytest.raises(ConversationNotFound):
        await store.edits.fork(fork.id, "bob", 1)  # another owner's is unknown
    with pytest.raises(InvalidInput):
        await store.edits.fork(fork.id, "alice", 4)


async def test_a_turn_keeps_its_whole_origin_and_a_fork_copies_it(
    contract_store: AnyStore,
) -> None:
    """A turn's origin comes back as it was committed: provider, endpoint, model, the
    provider's kind and its key's fingerprint (none of it for a turn that had no origin)."""
    store, cid = contract_store, uuid.uuid4()
    made_by = Origin("claude", "https://api.anthropic.com/v1/messages", "claude-x", "anthropic",
                     "0123456789ab")  # fmt: skip
    await store.history.append(Append(cid, replace(turn(1), origin=made_by), 0, owner="alice"))
    await store.history.append(Append(cid, turn(2), 1, owner="alice"))
    fork = await store.edits.fork(cid, "alice", 2)
    for conversation in (cid, fork.id):
        loaded = await store.history.load(conversation, "alice")
        assert loaded is not None
        first, second = loaded.turns
        assert first.origin is not None and second.origin is None
        got = first.origin
        assert (got.provider, got.endpoint, got.model) == ("claude", made_by.endpoint, "claude-x")
        assert (got.kind, got.key_fingerprint) == ("anthropic", "0123456789ab")


async def test_an_empty_conversation_takes_its_first_turn_and_keeps_its_metadata(
    contract_store: AnyStore,
) -> None:
    store = contract_store
    made = await store.edits.create_conversation("alice", {"topic": "t"})
    assert (made.revision, made.metadata) == (0, {"topic": "t"})
    commit = await store.history.append(Append(made.id, turn(1), 0, owner="alice"))
    assert commit.revision == 1
    with pytest.raises(ConversationConflict):
        await store.history.append(Append(made.id, turn(2), 0, owner="alice"))  # no longer empty
    updated = await store.edits.update_metadata(made.id, "alice", {"topic": "u"}, frozenset({1}))
    assert (updated.revision, updated.metadata) == (1, {"topic": "u"})
    with pytest.raises(PreconditionFailed):
        await store.edits.update_metadata(made.id, "alice", {}, frozenset({0}))
    assert await store.reads.describe(made.id, "bob") is None


async def test_the_latest_item_is_removed_by_a_commit_that_marks_the_rewrite(
    contract_store: AnyStore,
) -> None:
    store, cid = contract_store, uuid.uuid4()
    for n in (1, 2):
        await store.history.append(Append(cid, turn(n), n - 1, owner="alice"))

    info, removed = await store.history.pop_item(Removal(cid, "alice"), frozenset({2}))
    assert info.revision == 3 and bytes(removed) == bytes(turn(2).replay_items[-1])
    loaded = await store.history.load(cid, "alice")
    assert loaded is not None and loaded.revision == 3 and loaded.rewritten_at == 3
    assert [bytes(i) for i in loaded.replay_items] == [
        *map(bytes, turn(1).replay_items), bytes(turn(2).replay_items[0])
    ]  # fmt: skip
    with pytest.raises(PreconditionFailed):
        await store.history.pop_item(Removal(cid, "alice"), frozenset({2}))
    commit = await store.history.append(Append(cid, turn(3), 3, owner="alice"))
    assert commit.revision == 4


async def test_a_compacted_context_is_kept_with_its_turn_byte_for_byte(
    contract_store: AnyStore,
) -> None:
    """What a compacting turn ran on comes back as it went in, is copied by a fork and kept
    when the turn's latest item is removed (sealed too, with encryption at rest)."""
    store, cid = contract_store, uuid.uuid4()
    compacted = (
        msgspec.Raw(b'{"type":"message","role":"user","content":"u1"}'),
        msgspec.Raw(b'{"type":"compaction","id":"cmp_1","encrypted_content":"gA\\u00e9x=="}'),
    )
    await store.history.append(Append(cid, turn(1), 0, owner="alice"))
    await store.history.append(
        Append(cid, Turn("u2", "a2", turn(2).replay_items, compacted=compacted), 1, owner="alice")
    )
    loaded = await store.history.load(cid, "alice")
    assert loaded is not None
    assert [t.compacted for t in loaded.turns] == [(), compacted]
    assert [bytes(i) for i in loaded.turns[1].compacted] == [bytes(i) for i in compacted]
    fork = await store.edits.fork(cid, "alice", 2)
    forked = await store.history.load(fork.id, "alice")
    assert forked is not None and list(forked.turns[1].compacted) == list(compacted)
    await store.history.pop_item(Removal(cid, "alice"), frozenset({2}))
    popped = await store.history.load(cid, "alice")
    assert popped is not None and list(popped.turns[-1].compacted) == list(compacted)


async def test_turn_sizes_are_what_each_turn_holds_measured_without_reading_it(
    contract_store: AnyStore,
) -> None:
    """As service/core/sizes.py counts them (every column a turn stores), known without
    reading the turn, sealed or not (its size is stored with it; only a sealed turn an older
    release wrote is None: it is read instead)."""
    store, cid = contract_store, uuid.uuid4()
    compacting = replace(turn(2), compacted=[msgspec.Raw(b'{"type":"compaction" , "n":1}')])
    empty = replace(turn(3), replay_items=[])
    for n, each in enumerate((turn(1), compacting, empty)):
        await store.history.append(Append(cid, each, n))
    sizes = await store.reads.turn_sizes(cid, ANONYMOUS, 1, 3)
    assert [seq for seq, _ in sizes] == [1, 2, 3]
    expected = [turn_bytes(t) for t in (turn(1), compacting, empty)]
    assert [size for _, size in sizes] == expected
    assert await store.reads.turn_sizes(cid, "someone else", 1, 3) == []


async def test_a_conversation_without_a_stored_size_is_counted_whole(
    contract_store: AnyStore,
) -> None:
    """usecases/paging.held_bytes over every store: measured where the database can, read
    where it cannot (sealed), the same total; from the stored count on where there is one."""
    store, cid = contract_store, uuid.uuid4()
    turns = [turn(1), turn(2), replace(turn(3), compacted=[msgspec.Raw(b'{"type":"c"}')])]
    for n, each in enumerate(turns):
        await store.history.append(Append(cid, each, n))
    unknown = ConversationInfo(cid, 3, datetime.now(UTC), datetime.now(UTC), {})
    assert await held_bytes(store.reads, cid, ANONYMOUS, 3, unknown) == sum(map(turn_bytes, turns))
    at_two = replace(unknown, stored_bytes=7, stored_revision=2)
    assert await held_bytes(store.reads, cid, ANONYMOUS, 3, at_two) == 7 + turn_bytes(turns[2])


# --- OWNER_MAX_RUNNING_TURNS: an owner's places among the running turns ----------------------


@pytest.fixture
def counting_store(request: pytest.FixtureRequest) -> AnyStore:
    """A store that lets each owner run two turns at once (in clear: places are not sealed)."""
    if request.param == "memory":
        return MemoryStore(running_turns=2)
    return PostgresStore.over(request.getfixturevalue("engine"), StoreConfig(running_turns=2))


def owner() -> str:
    """An owner of this test alone (the database is shared by the module's tests)."""
    return f"owner-{uuid.uuid4().hex[:8]}"


async def test_an_owner_runs_at_most_its_running_turns(counting_store: AnyStore) -> None:
    store, alice, bob = counting_store, owner(), owner()
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert await store.places.take_turn(alice, a, 30)
    assert await store.places.take_turn(alice, a, 30)  # its own place again: renewed, not counted
    assert await store.places.take_turn(alice, b, 30)
    assert not await store.places.take_turn(alice, c, 30)
    assert await store.places.take_turn(bob, c, 30)  # every owner has a count of their own
    await store.places.free_turn(alice, a)
    assert await store.places.take_turn(alice, c, 30)


async def test_a_place_that_ran_out_stops_counting(counting_store: AnyStore) -> None:
    """A replica that dies stops renewing its turns' places; they stop counting when they
    run out (a renewal sets when)."""
    store, alice = counting_store, owner()
    lapsed, renewed, a, b = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert await store.places.take_turn(alice, lapsed, -1)
    assert await store.places.take_turn(alice, renewed, 30)
    await store.places.renew_turns([(alice, renewed)], -1)
    assert await store.places.take_turn(alice, a, 30)
    assert await store.places.take_turn(alice, b, 30)
    assert not await store.places.take_turn(alice, uuid.uuid4(), 30)


async def test_a_lease_takes_its_turns_place_and_the_commit_gives_it_back(
    counting_store: AnyStore,
) -> None:
    store, cid, holder, alice = counting_store, uuid.uuid4(), uuid.uuid4(), owner()
    await store.history.append(Append(cid, turn(1), 0, owner=alice))
    others = [uuid.uuid4(), uuid.uuid4()]
    for other in others:
        assert await store.places.take_turn(alice, other, 30)
    ask = LeaseRequest(cid, alice, holder, lease_s=30, queue=False)
    crowded = await store.history.lease(ask)
    assert crowded.crowded and not crowded.acquired
    await store.places.free_turn(alice, others[0])
    leased = await store.history.lease(ask)
    assert leased.acquired and not leased.crowded
    assert not await store.places.take_turn(alice, uuid.uuid4(), 30)  # the lease holds a place
    await store.history.append(Append(cid, turn(2), 1, owner=alice, lease=holder))
    assert await store.places.take_turn(alice, uuid.uuid4(), 30)  # the commit gave it back


# --- finding, accounting, moving (issue 35) -------------------------------------------------


def said(text_: str, model: str = "m1", tokens: int = 3) -> Turn:
    return Turn(
        text_,
        "fine",
        [msgspec.Raw(b'{"type":"message","role":"user","content":"x"}')],
        origin=Origin("p", "e", model),
        usage=Usage(input_tokens=tokens, output_tokens=1, total_tokens=tokens + 1),
    )


async def test_the_listing_finds_by_words_model_metadata_and_dates_the_owners_alone(
    contract_store: AnyStore,
) -> None:
    store = contract_store
    a, b, c = (uuid.uuid4() for _ in range(3))
    await store.history.append(Append(a, said("Kiwi and mango"), 0, owner="carol"))
    await store.history.append(Append(b, said("mango only", model="m2"), 0, owner="carol"))
    tagged = await store.edits.create_conversation("carol", {"k": "v w"}, said("a KIWI"))
    await store.history.append(Append(c, said("kiwi mango"), 0, owner="dave"))

    async def ids(**asked: object) -> set[uuid.UUID]:
        page, _ = await store.reads.list_conversations("carol", 10, None, Finding(**asked))  # type: ignore[arg-type]
        return {s.id for s in page}

    assert await ids(q="kiwi") == {a, tagged.id}
    assert await ids(q="MANGO kiwi") == {a}
    assert await ids(q="kiw") == set()
    assert await ids(model="m2") == {b}
    assert await ids(metadata=(("k", "v w"),)) == {tagged.id}
    assert await ids(metadata=(("k", "v"),)) == set()
    after = tagged.created_at - timedelta(microseconds=1)
    assert await ids(created_after=after) == {tagged.id}
    assert await ids(updated_before=after) == {a, b}
    await store.edits.update_metadata(tagged.id, "carol", {"k": "other"})
    assert await ids(metadata=(("k", "v w"),)) == set()
    assert await ids(metadata=(("k", "other"),), q="kiwi") == {tagged.id}


async def test_an_address_a_host_or_a_path_is_found_whole_and_by_each_of_its_words(
    contract_store: AnyStore,
) -> None:
    """Whatever the backend, in clear or not: PostgreSQL's parser keeps an e-mail address or a
    host whole, where the process (sealed terms, the in-memory store) finds words; both find
    it, in the conversation and in its fork (whose terms are made again)."""
    store = contract_store
    a = uuid.uuid4()
    text_ = "Write to Bob@example.com, see docs.example.org/a/b and ~/.ssh or /etc"
    await store.history.append(Append(a, said(text_), 0, owner="erin"))
    fork = await store.edits.fork(a, "erin", 1)
    for q in ("example", "bob@example.com", "example.com", "docs", "org", "b", "ssh", "etc"):
        page, _ = await store.reads.list_conversations("erin", 10, None, Finding(q=q))
        assert {s.id for s in page} == {a, fork.id}, q
    page, _ = await store.reads.list_conversations("erin", 10, None, Finding(q="exam"))
    assert page == []


async def test_usage_sums_each_committed_turns_usage_by_key(contract_store: AnyStore) -> None:
    store = contract_store
    a, b = uuid.uuid4(), uuid.uuid4()
    await store.history.append(Append(a, said("one", tokens=5), 0, owner="carol"))
    await store.history.append(Append(a, said("two", model="m2", tokens=7), 1, owner="carol"))
    await store.history.append(Append(b, said("three", tokens=11), 0, owner="carol"))
    await store.history.append(Append(uuid.uuid4(), said("dave's", tokens=99), 0, owner="dave"))
    since, until = datetime.now(UTC) - timedelta(hours=1), datetime.now(UTC) + timedelta(hours=1)
    by_model = await store.reads.usage("carol", since, until, "model")
    assert [(t.key, t.turns, t.usage.input_tokens) for t in by_model] == [
        ("m1", 2, 16),
        ("m2", 1, 7),
    ]
    by_conversation = {
        t.key: t.turns for t in await store.reads.usage("carol", since, until, "conversation")
    }
    assert by_conversation == {str(a): 2, str(b): 1}
    assert await store.reads.usage("carol", until, until + timedelta(hours=1), "day") == []


async def test_an_import_makes_the_same_turns_byte_for_byte_in_one_commit(
    contract_store: AnyStore,
) -> None:
    store = contract_store
    when = datetime(2026, 1, 2, tzinfo=UTC)
    turns = [replace(turn(n), number=n, created_at=when, context_from=1) for n in (1, 2)]
    imported = Imported({"k": "v"}, 2, 2, turns)
    info = await store.edits.import_conversation("carol", imported)
    assert info.revision == 2 and info.context_start == 2 and info.metadata == {"k": "v"}
    loaded = await store.history.load(info.id, "carol")
    assert loaded is not None
    assert [t.replay_items for t in loaded.turns] == [t.replay_items for t in turns]
    assert [t.created_at for t in loaded.turns] == [when, when]
    page, _ = await store.reads.list_conversations("carol", 10, None, Finding(q="assistant 2"))
    assert [s.id for s in page] == [info.id]
