"""/metrics counts turns by outcome; log lines are JSON with the correlation id and no
message text."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.platform.logs import JSONFormatter
from tests.conftest import ClientFactory
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


async def test_metrics_count_turns_by_outcome(make_client: ClientFactory) -> None:
    api = FakeResponsesAPI()
    async with make_client(provider=api.provider()) as client:
        before = await scrape(client)
        await client.post(CHAT, json={"message": "ok"})
        api.then(Script(http_status=429))
        await client.post(CHAT, json={"message": "limited"})
        api.then(Script(status="incomplete", incomplete_reason="content_filter", text="x"))
        await client.post(CHAT, json={"message": "filtered"})
        after = await scrape(client)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("turnstore_turns_committed_total", mode="chat") == 1
    assert delta("turnstore_turns_not_committed_total", mode="chat", reason="rate_limited") == 1
    assert delta("turnstore_turns_not_committed_total", mode="chat", reason="content_filtered") == 1
    assert delta("turnstore_turns_not_committed_total", mode="chat", reason="disconnect") == 0
    assert delta("turnstore_provider_seconds_count") == 3
    assert delta("turnstore_commit_seconds_count") == 1
    assert ("turnstore_db_pool_in_use", ()) in after
    assert ("turnstore_open_streams", ()) in after


async def test_log_lines_are_json_with_the_correlation_id(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeResponsesAPI().then(Script(http_status=500))
    caplog.set_level(logging.INFO)
    async with make_client(provider=api.provider()) as client:
        response = await client.post(
            CHAT, json={"message": "secret words"}, headers={"X-Correlation-Id": "trace-42"}
        )
    assert response.status_code == 502
    lines = [JSONFormatter().format(record) for record in caplog.records]
    ours = [
        json.loads(line) for line in lines if "upstream_error" in line and "turnstore.api" in line
    ]
    assert ours and all(entry["correlation_id"] == "trace-42" for entry in ours)
    assert not any("secret words" in line for line in lines)


async def test_open_streams_gauge_follows_streams(make_client: ClientFactory) -> None:
    import asyncio

    api = FakeResponsesAPI()
    gate = asyncio.Event()
    held = Script(gate=gate)
    api.then(held)
    async with make_client(provider=api.provider()) as client:
        idle = (await scrape(client))[("turnstore_open_streams", ())]
        async with client.stream("POST", f"{CHAT}/stream", json={"message": "hold"}) as response:
            await held.started.wait()
            assert (await scrape(client))[("turnstore_open_streams", ())] == idle + 1
            gate.set()
            await response.aread()
        assert (await scrape(client))[("turnstore_open_streams", ())] == idle


async def test_provider_failures_are_logged_with_the_providers_request_id(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeResponsesAPI().then(Script(http_status=500, headers={"x-request-id": "req_abc"}))
    caplog.set_level(logging.INFO)
    async with make_client(provider=api.provider()) as client:
        assert (await client.post(CHAT, json={"message": "hi"})).status_code == 502
    lines = [json.loads(JSONFormatter().format(r)) for r in caplog.records]
    provider = [line for line in lines if line["logger"] == "turnstore.provider"]
    assert provider and provider[0]["provider_request_id"] == "req_abc"
    assert provider[0]["level"] == "warning" and "500" in provider[0]["message"]


async def test_http_requests_are_counted_by_route_template(make_client: ClientFactory) -> None:
    async with make_client() as client:
        before = await scrape(client)  # one registry per process: count what this test adds
        cid = (await client.post(CHAT, json={"message": "hi"})).json()["conversation_id"]
        assert (await client.get(f"/api/v1/conversations/{cid}")).status_code == 200
        missing = "/api/v1/conversations/00000000-0000-0000-0000-000000000000"
        assert (await client.get(missing)).status_code == 404
        after = await scrape(client)
    added = {key: value - before.get(key, 0.0) for key, value in after.items()}
    route = "/api/v1/conversations/{conversation_id}"
    by_status = {
        labels: value
        for (name, labels), value in added.items()
        if name == "turnstore_http_requests_total" and ("route", route) in labels and value
    }
    assert by_status == {
        (("method", "GET"), ("route", route), ("status", "200")): 1.0,
        (("method", "GET"), ("route", route), ("status", "404")): 1.0,
    }
    assert not any(cid in str(labels) for (_, labels) in after)  # no raw paths
    chat = (("method", "POST"), ("route", "/api/v1/chat"))
    assert added[("turnstore_http_request_seconds_count", chat)] == 1.0
    assert ("process_resident_memory_bytes", ()) in after


def test_log_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.platform.logs import configure
    from service.platform.settings import Settings

    monkeypatch.setenv("LOG_LEVEL", "warning")
    settings = Settings.from_env()
    try:
        configure(settings.log_format, settings.log_level.upper())  # as the app wires it
        assert not logging.getLogger("turnstore.api").isEnabledFor(logging.INFO)
        assert logging.getLogger("turnstore.api").isEnabledFor(logging.WARNING)
    finally:
        configure("json", "INFO")
