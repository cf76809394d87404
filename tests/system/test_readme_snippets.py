"""The README's client snippets ("Use it from the OpenAI SDK") run as written against a served
turnstore (the built-in fake, real PostgreSQL): each Python block in a process of its own,
the JavaScript block under Node with the npm packages of tests/js. Only the address changes:
``http://localhost:8000`` becomes the served one.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from service.app import create_app
from service.platform.settings import Settings
from service.providers.fake import FakeProvider
from tests.support.helpers import serve
from tests.support.node import JS

REPO = Path(__file__).resolve().parents[2]
SECTION = "### Use it from the OpenAI SDK"


def snippets(language: str) -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split(SECTION, 1)[1].split("\n### ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def test_the_section_has_its_snippets() -> None:
    assert len(snippets("python")) == 2 and len(snippets("js")) == 1


async def run(command: list[str], cwd: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    process = await asyncio.create_subprocess_exec(
        *command, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, output.decode()


@pytest.mark.parametrize("number", [0, 1])
async def test_a_python_snippet_runs_as_written(
    database_url: str, tmp_path: Path, number: int
) -> None:
    code = snippets("python")[number]
    app = create_app(Settings(database_url=database_url), provider=FakeProvider())
    async with serve(app) as url:
        script = tmp_path / "snippet.py"
        script.write_text(code.replace("http://localhost:8000", url))
        status, output = await run([sys.executable, str(script)], tmp_path)
    assert status == 0, output
    assert "[fake-llm]" in output, output


async def test_the_javascript_snippet_runs_as_written(database_url: str) -> None:
    if shutil.which("node") is None or not (JS / "node_modules" / "openai").exists():
        pytest.skip("needs Node.js and `make js-deps`")
    code = snippets("js")[0]
    app = create_app(Settings(database_url=database_url), provider=FakeProvider())
    script = JS / "readme-snippet.tmp.mjs"  # beside node_modules, so that "openai" resolves
    async with serve(app) as url:
        script.write_text(code.replace("http://localhost:8000", url))
        try:
            status, output = await run(["node", str(script)], JS)
        finally:
            script.unlink()
    assert status == 0, output
    assert "[fake-llm] ping" in output, output
