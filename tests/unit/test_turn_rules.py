"""The turn rules against the in-memory store: the use case alone, in milliseconds.

TurnService and Exchange built directly, with MemoryStore (which passes the same store
contract as PostgreSQL, tests/contracts/store.py) and a scripted provider. Everything that touches
the database or HTTP is tested for real elsewhere; this layer is where a new rule gets its
first, fast test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest

from service.core.errors import (
    ContentFiltered,
    ConversationBusy,
    ConversationConflict,
    InvalidEncryptedContent,
    InvalidInput,
    PreconditionFailed,
    RateLimited,
    UpstreamError,
)
from service.core.items import user_input_item
from service.core.model import ANONYMOUS, Append, LeaseRequest, Origin, Turn
from service.core.plans import PlanRules, chat_request, make_plan
from service.core.window import Budget
from service.providers.base import Provider, ProviderEvent, ProviderRequest, Reply, TextDelta
from service.providers.fake import FakeProvider
from service.tools.executor import ToolExecutor
from service.tools.registry import ToolRegistry
from service.usecases.exchange import Tooling
from service.usecases.leases import LeasePolicy, Leases
from service.usecases.turns import TurnDone, TurnService
from service.usecases.write_gate import WriteGate
from tests.support.memory import MemoryStore
from tests.support.tools_fixtures import Echo

ORIGIN = Origin("scripted", "memory", "m")


def item(**fields: Any) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(fields))


def message(text: str) -> msgspec.Raw:
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return item(type="message", role="assistant", content=content)


def sealed(name: str) -> msgspec.Raw:
    return item(type="reasoning", id=name, summary=[], encrypted_content="sealed-" + name)


class Scripted(Provider):
    """A provider that answers each request with the next scripted reply (or raises it)."""

    def __init__(self, *answers: Reply | Exception, origin: Origin = ORIGIN) -> None:
        self.origin = origin
        self.requests: list[ProviderRequest] = []
        self._answers: deque[Reply | Exception] = deque(answers)

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        self.requests.append(request)
        answer = self._answers.popleft()
        if isinstance(answer, Exception):
            raise answer
        if stream and answer.text:
            yield TextDelta(answer.text)
        yield answer

    async def close(self) -> None:
        return None


def reply(text: str, *, status: str = "completed", reason: str | None = None) -> Reply:
    return Reply(text, status, reason, [sealed("rs_" + text), message(text)])  # type: ignore[arg-type]


def service(
    provider: Any, store: MemoryStore | None = None, policy: LeasePolicy | None = None, **kw: Any
) -> TurnService:
    store = store or MemoryStore()
    leases = Leases(store, store, store.notifications, policy)
    return TurnService(store, provider, leases=leases, **kw)


async def turn(turns: TurnService, text: str, cid: uuid.UUID | None = None, **kw: Any) -> TurnDone:
    rules = PlanRules(max_message_chars=1000)
    if_match = kw.pop("if_match", None)
    plan = make_plan(
        rules, chat_request(ANONYMOUS, text, str(cid) if cid else None, if_match, **kw)
    )
    return await turns.run(plan)


async def test_a_completed_reply_commits_the_user_item_and_every_output_item() -> None:
    provider, store = Scripted(reply("hello")), MemoryStore()
    turns = service(provider, store)
    done = await turn(turns, "hi")
    assert (done.message, done.status, done.revision) == ("hello", "completed", 1)
    loaded = await store.load(done.conversation_id)
    assert loaded is not None
    assert loaded.turns[0].replay_items == [user_input_item("hi"), *reply("hello").output_items]
    assert loaded.turns[0].origin == ORIGIN


async def test_an_incomplete_max_output_tokens_reply_commits_what_was_received() -> None:
    turns = service(Scripted(reply("cut", status="incomplete", reason="max_output_tokens")))
    done = await turn(turns, "long")
    assert (done.status, done.incomplete_reason, done.revision) == (
        "incomplete",
        "max_output_tokens",
        1,
    )


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (reply("x", status="incomplete", reason="content_filter"), ContentFiltered),
        (Reply("", "completed", None, [message("")]), UpstreamError),
        (RateLimited(retry_after="3"), RateLimited),
        (UpstreamError(), UpstreamError),
    ],
    ids=["content_filter", "empty", "rate_limited", "upstream_error"],
)
async def test_a_refused_or_failed_reply_commits_nothing(
    answer: Reply | Exception, error: type[Exception]
) -> None:
    store = MemoryStore()
    turns = service(Scripted(reply("first"), answer), store)
    first = await turn(turns, "one")
    with pytest.raises(error):
        await turn(turns, "two", first.conversation_id)
    loaded = await store.load(first.conversation_id)
    assert loaded is not None and loaded.revision == 1 and len(loaded.turns) == 1


async def test_a_failed_precondition_is_found_before_the_provider_is_called() -> None:
    provider = Scripted(reply("a"))
    turns = service(provider)
    done = await turn(turns, "one")
    with pytest.raises(PreconditionFailed):
        await turn(turns, "two", done.conversation_id, if_match=frozenset({7}))
    assert len(provider.requests) == 1


async def test_a_stale_writer_conflicts_and_writes_nothing() -> None:
    store = MemoryStore()
    cid = uuid.uuid4()
    await store.append(Append(cid, Turn("u", "a", [user_input_item("u")]), 0))
    late = Turn("late", "x", [user_input_item("late")])
    with pytest.raises(ConversationConflict):
        await store.append(Append(cid, late, 0))
    loaded = await store.load(cid)
    assert loaded is not None and [t.user_message for t in loaded.turns] == ["u"]


async def test_the_window_keeps_whole_recent_turns_and_its_start_only_advances() -> None:
    provider = Scripted(*(reply(f"r{n}") for n in range(4)))
    store = MemoryStore()
    turns = service(provider, store, budget=Budget(max_turns=1))
    cid = (await turn(turns, "t0")).conversation_id
    for n in range(1, 4):
        await turn(turns, f"t{n}", cid)
    sent = provider.requests[-1].input_items
    assert sent == [user_input_item("t2"), *reply("r2").output_items, user_input_item("t3")]
    loaded = await store.load(cid)
    assert loaded is not None and loaded.context_start == 3
    assert [t.context_from for t in loaded.turns] == [1, 1, 2, 3]


async def test_sealed_reasoning_of_another_origin_is_left_out_and_a_refusal_retried_once() -> None:
    store = MemoryStore()
    first = await turn(service(Scripted(reply("a"), origin=Origin("old", "e", "m")), store), "1")
    provider = Scripted(InvalidEncryptedContent(), reply("b"))
    # Same origin now: its sealed item is sent; the provider refuses it once; the retry drops it.
    turns = service(provider, store)
    provider.origin = Origin("old", "e", "m")
    await turn(turns, "2", first.conversation_id)
    with_sealed, without = (r.input_items for r in provider.requests)
    assert sealed("rs_a") in with_sealed and sealed("rs_a") not in without
    other = Scripted(reply("c"))  # another origin: its sealed items are not sent at all
    await turn(service(other, store), "3", first.conversation_id)
    assert not any(b'"encrypted_content"' in bytes(i) for i in other.requests[0].input_items[:2])


async def test_a_tool_turn_commits_calls_and_outputs_in_order() -> None:
    call = item(type="function_call", call_id="c1", name="echo", arguments='{"text": "x"}')
    provider = Scripted(Reply("", "completed", None, [call]), reply("done"))
    executor = ToolExecutor(1)
    tooling = Tooling(ToolRegistry([Echo()]), executor)
    try:
        done = await turn(service(provider, tooling=tooling), "use echo")
    finally:
        executor.shutdown()
    assert done.message == "done"
    second = provider.requests[1].input_items
    assert second[:2] == [user_input_item("use echo"), call]
    assert msgspec.json.decode(second[2])["type"] == "function_call_output"


async def test_an_idempotent_retry_replays_the_commit_without_the_provider() -> None:
    store = MemoryStore()
    provider = Scripted(reply("once"))
    turns = service(provider, store, gate=WriteGate(store))
    first = await turn(turns, "pay", idempotency_key="k1")
    again = await turn(turns, "pay", idempotency_key="k1")
    assert again == first and len(provider.requests) == 1


async def test_the_fake_provider_sees_its_history() -> None:
    turns = service(FakeProvider())
    first = await turn(turns, "ping")
    second = await turn(turns, "pong", first.conversation_id)
    assert second.message == "[fake-llm] pong (history=2)"


async def test_leases_meet_a_second_turn_the_same_way_as_across_replicas() -> None:
    """One turn holds the lease (its provider call is held back); a second one either fails
    at once (reject) or waits and runs on top of the first (queue)."""
    for queue in (False, True):
        store = MemoryStore()
        release = asyncio.Event()
        held_back = HeldBack(release, reply("slow"))
        first = await turn(service(FakeProvider(), store), "seed")
        policy = LeasePolicy(queue=queue, queue_wait_s=5)
        slow_service = service(held_back, store, policy)
        slow = asyncio.ensure_future(turn(slow_service, "slow", first.conversation_id))
        await held_back.started.wait()
        other = service(FakeProvider(), store, policy)  # another replica: its own locks
        second = asyncio.ensure_future(turn(other, "second", first.conversation_id))
        if not queue:
            with pytest.raises(ConversationBusy):
                await second
        release.set()
        assert (await slow).revision == 2
        if queue:
            done = await second
            assert done.revision == 3 and done.message.endswith("(history=4)")


async def test_a_stale_holder_loses_to_the_turn_that_took_its_expired_lease() -> None:
    store = MemoryStore()
    cid = uuid.uuid4()
    await store.append(Append(cid, Turn("u", "a", [user_input_item("u")]), 0))
    old, new = uuid.uuid4(), uuid.uuid4()
    assert (
        await store.lease(LeaseRequest(cid, ANONYMOUS, old, lease_s=0.01, queue=False))
    ).acquired
    await asyncio.sleep(0.02)  # the only way to let a lease run out: its time passes
    assert (await store.lease(LeaseRequest(cid, ANONYMOUS, new, lease_s=30, queue=False))).acquired
    with pytest.raises(ConversationConflict):
        await store.append(Append(cid, Turn("late", "x", [user_input_item("l")]), 1, lease=old))
    await store.append(Append(cid, Turn("new", "y", [user_input_item("n")]), 1, lease=new))


class HeldBack(Scripted):
    """Scripted, but its answer waits for ``release``."""

    def __init__(self, release: asyncio.Event, answer: Reply) -> None:
        super().__init__(answer)
        self.release, self.started = release, asyncio.Event()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        self.started.set()
        await self.release.wait()
        async for event in super().respond(request, stream=stream):
            yield event


def test_an_idempotency_key_hashes_a_plain_turn_as_the_previous_release_did() -> None:
    """Keys claimed before an upgrade (or by a replica not yet upgraded) must still match
    their retries: a plain turn's subject is [message, conversation id], as it was."""
    import hashlib

    cid = str(uuid.uuid4())
    rules = PlanRules(max_message_chars=100)
    plain = make_plan(rules, chat_request(ANONYMOUS, "hi", cid, None, idempotency_key="k"))
    old = hashlib.sha256(msgspec.json.encode(["hi", cid])).hexdigest()
    assert plain.idempotency is not None and plain.idempotency.request_hash == old
    background = make_plan(
        rules, chat_request(ANONYMOUS, "hi", cid, None, idempotency_key="k", background=True)
    )
    assert background.idempotency is not None and background.idempotency.request_hash != old


@pytest.mark.parametrize("model", ["gpt\x00x", "gpt\udc00"], ids=["nul", "lone-surrogate"])
def test_a_model_name_no_provider_or_row_can_take_is_400_naming_model(model: str) -> None:
    """With any model allowed (MODELS=*), a name holding NUL or a lone surrogate is the
    request's fault (the fuzzer's find: it reached the turn's row and failed there as 500
    storage_error, after the provider call)."""
    with pytest.raises(InvalidInput) as refused:
        PlanRules(models=None).check_model(model)
    assert refused.value.param == "model"
    PlanRules(models=None).check_model("accounts/fireworks/models/qwen3-235b")  # any other
