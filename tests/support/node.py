"""The Node side of the tests: the npm packages in tests/js (`make js-deps`) and a test file of
theirs run under Node's own test runner against an app served over loopback."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import serve

JS = Path(__file__).resolve().parents[1] / "js"


def node() -> str:
    """The node executable; the test skips without it or tests/js/node_modules (fails in CI)."""
    path = shutil.which("node")
    installed = (JS / "node_modules" / "openai").is_dir()
    if path is None or not installed:
        reason = "node and tests/js/node_modules are needed (`make test` installs the latter)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


async def node_test(app: Any, name: str) -> tuple[int | None, str]:
    """``tests/js/<name>.test.mjs`` under ``node --test`` against ``app`` (its URL in
    TURNSTORE_URL): the exit status and the report."""
    executable = node()
    async with serve(app) as url:
        process = await asyncio.create_subprocess_exec(
            executable, "--test", str(JS / f"{name}.test.mjs"),
            env={**os.environ, "TURNSTORE_URL": url},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode, output.decode()
