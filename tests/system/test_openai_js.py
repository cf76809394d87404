"""The official ``openai`` npm package against /v1 (tests/js/openai.test.mjs under Node's
own test runner): the JavaScript SDK parses what turnstore answers, streams included."""

from __future__ import annotations

from service.app import create_app
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from tests.support.node import node_test


async def test_the_javascript_sdk(database_url: str) -> None:
    app = create_app(Settings(database_url=database_url), provider=FakeProvider())
    status, report = await node_test(app, "openai")
    assert status == 0, report
    assert "# pass 3" in report and "# fail 0" in report, report
