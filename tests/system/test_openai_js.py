"""The official ``openai`` npm package against /v1 (tests/js/openai.test.mjs under Node's
own test runner): the JavaScript SDK parses what turnstore answers, streams included."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from service.app import create_app
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from tests.support.helpers import serve

JS = Path(__file__).resolve().parents[1] / "js"


def node() -> str:
    path = shutil.which("node")
    installed = (JS / "node_modules" / "openai").is_dir()
    if path is None or not installed:
        reason = "node and tests/js/node_modules are needed (`make test` installs the latter)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


async def test_the_javascript_sdk(database_url: str) -> None:
    executable = node()
    app = create_app(Settings(database_url=database_url), provider=FakeProvider())
    async with serve(app) as url:
        process = await asyncio.create_subprocess_exec(
            executable, "--test", str(JS / "openai.test.mjs"),
            env={**os.environ, "TURNSTORE_URL": url},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 120)
    report = output.decode()
    assert process.returncode == 0, report
    assert "# pass 3" in report and "# fail 0" in report, report
