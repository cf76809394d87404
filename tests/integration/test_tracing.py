"""Traces: the span tree of a committed turn, a conflicted turn and a tool turn, recorded by the
SDK's in-memory exporter; the client's traceparent is continued and passed to the provider;
no message text in any span."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.ext.asyncio import AsyncEngine

from service.platform.logs import JSONFormatter
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, stale_and_fresh, until_lease_expired

EXPORTER = InMemorySpanExporter()
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture(scope="module", autouse=True)
def recorded() -> Iterator[None]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)  # once per process: the first provider stays
    yield


@pytest.fixture(autouse=True)
def fresh() -> None:
    EXPORTER.clear()


def tree(root_name: str) -> dict[str, list[ReadableSpan]]:
    """The spans under the request span ``root_name``, by name."""
    spans = EXPORTER.get_finished_spans()
    root = next(s for s in spans if s.name == root_name)
    ids = {root.context.span_id}
    under: dict[str, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        if span.parent is not None and span.parent.span_id in ids:
            ids.add(span.context.span_id)
            under.setdefault(span.name, []).append(span)
    return under


async def test_a_committed_turn(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        first = await client.post(CHAT, json={"message": "secret words"})
        cid = first.json()["conversation_id"]
        EXPORTER.clear()
        body = {"message": "more secret words", "conversation_id": cid}
        response = await client.post(CHAT, json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    spans = tree("POST /api/v1/chat")
    assert set(spans) == {"turn.lease", "provider.round", "turn.commit"}
    assert spans["turn.commit"][0].attributes == {
        "turnstore.outcome": "committed", "turnstore.revision": 2
    }  # fmt: skip
    assert spans["provider.round"][0].attributes["provider.model"] == "gpt-test"  # type: ignore[index]
    root = next(s for s in EXPORTER.get_finished_spans() if s.name == "POST /api/v1/chat")
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the client's trace, continued
    assert api.headers[-1]["traceparent"].split("-")[1] == TRACE_ID  # and passed on
    everything = str([(s.name, s.attributes) for s in EXPORTER.get_finished_spans()])
    assert "secret" not in everything


async def test_a_tool_turn(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI().then(Script(calls=[("shout", '{"text": "hi"}')]))
    async with make_client(
        provider=api.provider(), tools="tests.integration.test_tool_turns:shout"
    ) as client:
        assert (await client.post(CHAT, json={"message": "use tools"})).status_code == 200
    spans = tree("POST /api/v1/chat")
    assert len(spans["provider.round"]) == 2
    assert [s.attributes for s in spans["tool.call"]] == [
        {"tool.name": "shout", "tool.status": "OK"}
    ]
    assert "turn.lease" not in spans  # a new conversation has nothing to lease


def test_log_lines_join_their_trace() -> None:
    record = logging.LogRecord("turnstore.api", logging.INFO, "", 0, "inside", None, None)
    outside = json.loads(JSONFormatter().format(record))
    assert "trace_id" not in outside
    with trace.get_tracer("test").start_as_current_span("request") as span:
        inside = json.loads(JSONFormatter().format(record))
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")


async def test_a_conflicted_turn(database_url: str, engine: AsyncEngine) -> None:
    api = FakeResponsesAPI()
    async with stale_and_fresh(database_url, engine, api, turn_lease_s=1) as (a, b):
        cid = (await a.post(CHAT, json={"message": "one"})).json()["conversation_id"]
        gate = asyncio.Event()
        slow = Script(gate=gate)
        api.then(slow)
        loser = asyncio.create_task(a.post(CHAT, json={"message": "a", "conversation_id": cid}))
        await slow.started.wait()
        await until_lease_expired(engine, cid)
        assert (
            await b.post(CHAT, json={"message": "b", "conversation_id": cid})
        ).status_code == 200
        EXPORTER.clear()
        gate.set()
        assert (await loser).status_code == 409
    commits = [s for s in EXPORTER.get_finished_spans() if s.name == "turn.commit"]
    assert [s.attributes["turnstore.outcome"] for s in commits] == ["conversation_conflict"]  # type: ignore[index]
