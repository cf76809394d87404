"""The console (/console) and the API docs (/schema/swagger) in real headless Chromium: Debian's
`chromium` driven by the npm package playwright-core under Node's test runner
(tests/browser/*.test.mjs), against served turnstore apps with the fake provider.

Screenshots of the main views go to a temporary folder, or to ``$SCREENSHOTS`` when set
(``SCREENSHOTS=docs/console`` refreshes the ones the README shows).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.app import create_app
from service.platform.settings import Settings
from service.providers.base import ProviderEvent, ProviderRequest, TextDelta
from service.providers.fake import FakeProvider
from service.store.postgres import ApiKeyStore
from tests.conftest import ClientFactory
from tests.support.helpers import serve

BROWSER = Path(__file__).resolve().parents[1] / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding"}


def node() -> str:
    path = shutil.which("node")
    missing = [
        what
        for what, there in (
            ("node", path is not None),
            ("chromium (`make system-deps` installs it as root)", Path(CHROMIUM).exists()),
            ("tests/browser/node_modules (`make browser-deps`)",
             (BROWSER / "node_modules" / "playwright-core").is_dir()),
        )
        if not there
    ]  # fmt: skip
    if missing:
        reason = "the browser tests need " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    assert path is not None
    return path


async def run_browser(script: str, url: str, shots: Path, **env: str) -> str:
    process = await asyncio.create_subprocess_exec(
        node(), "--test", str(BROWSER / script),
        env={**os.environ, "TURNSTORE_URL": url, "SCREENSHOTS": str(shots), "CHROMIUM": CHROMIUM,
             **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 180)
    report = output.decode()
    assert process.returncode == 0, report
    assert "# fail 0" in report, report
    return report


def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class HeldProvider(FakeProvider):
    """The fake provider, except that a message starting with "slow" stops after its first
    delta until the test lets go: a turn still running when the page reloads or cancels."""

    def __init__(self) -> None:
        super().__init__(deltas=4)
        self._gate = asyncio.Event()

    def release(self) -> None:
        self._gate.set()
        self._gate = asyncio.Event()

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        gate = self._gate if text_of(request.input_items[-1]).startswith("slow") else None
        async with aclosing(super().respond(request, stream=stream)) as events:
            async for event in events:
                yield event
                if gate is not None and isinstance(event, TextDelta):
                    await gate.wait()
                    gate = None


def text_of(item: msgspec.Raw) -> str:
    content = msgspec.json.decode(item).get("content", "")
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)


class Balancer:
    """One origin for the page in front of two replicas, as a load balancer is: every request
    goes to the current replica (named in the answer's X-Test-Replica); POST /__test/switch
    sends all later ones to the other, POST /__test/release lets the held turns go on."""

    def __init__(self, replicas: dict[str, str], provider: HeldProvider) -> None:
        self.replicas, self.current, self.provider = replicas, "a", provider
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(30, read=None))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"].startswith("/__test/"):
            await self.control(scope["path"], send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        query = scope["query_string"].decode()
        target = scope["raw_path"].decode() + (f"?{query}" if query else "")
        url = self.replicas[self.current] + target
        headers = [(k, v) for k, v in scope["headers"] if k.decode() not in HOP_BY_HOP | {"host"}]
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        relay = asyncio.create_task(self.relay(request, self.current, send))
        gone = asyncio.create_task(disconnected(receive))
        done, pending = await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()  # the browser went away (a reload): so does the upstream request
        await asyncio.gather(*pending, return_exceptions=True)
        if relay in done:
            relay.result()

    async def relay(self, request: httpx.Request, replica: str, send: Any) -> None:
        response = await self.client.send(request, stream=True)
        try:
            headers = [
                (name.encode(), value.encode())
                for name, value in response.headers.multi_items()
                if name not in HOP_BY_HOP
            ]
            headers.append((b"x-test-replica", replica.encode()))
            start = {"type": "http.response.start", "status": response.status_code}
            await send({**start, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def control(self, path: str, send: Any) -> None:
        if path == "/__test/switch":
            self.current = "b" if self.current == "a" else "a"
        elif path == "/__test/release":
            self.provider.release()
        body = json.dumps({"replica": self.current}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def test_the_console_signed_in_with_api_keys_across_two_replicas(
    database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    node()
    keys = ApiKeyStore(engine)
    alice, bob = await keys.create("alice"), await keys.create("bob")
    provider = HeldProvider()
    settings = Settings(database_url=database_url, auth_mode="api_key")
    a, b = create_app(settings, provider=provider), create_app(settings, provider=provider)
    async with serve(a) as url_a, serve(b) as url_b:
        balancer = Balancer({"a": url_a, "b": url_b}, provider)
        async with serve(balancer, lifespan="off") as url:
            bobs = await balancer.client.post(
                f"{url_b}/api/v1/chat", json={"message": "bob's own"},
                headers={"Authorization": f"Bearer {bob}"},
            )  # fmt: skip
            assert bobs.status_code == 200, bobs.text
            await run_browser(
                "console.test.mjs", url, screenshots(tmp_path),
                ALICE_KEY=alice, BOB_CONVERSATION=bobs.json()["conversation_id"],
            )  # fmt: skip
            await balancer.client.aclose()


async def test_the_console_without_authentication_and_the_api_docs_offline(
    make_client: ClientFactory, tmp_path: Path
) -> None:
    node()
    async with make_client(context_max_turns=1) as client:
        await run_browser("none.test.mjs", str(client.base_url).rstrip("/"), screenshots(tmp_path))


async def test_the_console_is_public_static_files_under_a_strict_policy(
    client: httpx.AsyncClient,
) -> None:
    """No browser needed: the page, its policy, and Swagger's assets served from here."""
    page = await client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert "unsafe" not in policy and "form-action 'none'" in policy
    assert re.findall(r"<script[^>]*>", page.text) == [
        '<script type="module" src="/console/js/main.js">'
    ]  # no inline script
    module = await client.get("/console/js/main.js")
    assert module.headers["content-type"].startswith("text/javascript"), module.headers
    swagger = await client.get("/schema/swagger")
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", swagger.text)
    assert len(assets) == 4, assets  # favicon, CSS, bundle, preset
    for asset in assets:
        assert asset.startswith("/console/"), asset
        assert (await client.get(asset)).status_code == 200, asset
    paths = (await client.get("/schema")).json()["paths"]
    assert paths and not [path for path in paths if path.startswith("/console")]
