"""The npm clients as their documentation shows them, against a served turnstore's /v1 (issue
"20."), each file under Node's own test runner: the OpenAI Agents SDK (tests/js/agents.test.mjs),
the Vercel AI SDK (tests/js/ai-sdk.test.mjs) and the openai package's helpers
(tests/js/openai-helpers.test.mjs).

The provider is the fake Responses API (tests/support/fakeapi.py), reached by the real adapter. The
node tests talk to it through two routes this test process adds beside the app (see
tests/js/fake.mjs): ``POST /_fake/answers`` scripts the next calls' answers and forgets the
requests seen so far, ``GET /_fake/requests`` gives the bodies the provider received since.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.platform.settings import Settings
from tests.support.cluster import read_body
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.node import node_test

FAKE = "/_fake/"


class WithFake:
    """The ASGI app, plus the two /_fake/ routes over ``api``."""

    def __init__(self, app: Any, api: FakeResponsesAPI) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(FAKE):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        route = (scope["method"], scope["path"].removeprefix(FAKE))
        answer: Any
        if route == ("POST", "answers"):
            self.api.anew(*(script(answer) for answer in json.loads(body)))
            status, answer = 200, {"ok": True}
        elif route == ("GET", "requests"):
            status, answer = 200, self.api.requests
        else:
            status, answer = 404, {"error": "no such fake route"}
        data = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def script(answer: dict[str, Any]) -> Script:
    calls = answer.pop("calls", None)
    return Script(**answer, calls=[tuple(call) for call in calls] if calls else None)


@pytest.mark.parametrize("name", ["agents", "ai-sdk", "openai-helpers"])
async def test_the_npm_clients(database_url: str, engine: AsyncEngine, name: str) -> None:
    api = FakeResponsesAPI()
    settings = Settings(database_url=database_url, models="gpt-other")
    app = WithFake(create_app(settings, provider=api.provider()), api)
    status, report = await node_test(app, name)
    assert status == 0, report
    counts = dict(re.findall(r"^# (tests|pass|fail) (\d+)$", report, re.MULTILINE))
    assert counts["fail"] == "0" and counts["pass"] == counts["tests"] != "0", report
