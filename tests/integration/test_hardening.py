"""The findings of the first release's hostile review ("9. Hardening"), one test each, over
real HTTP against real PostgreSQL. Each of them failed before its fix. (The cost of hostile
bodies is measured in bench/hostile.py, not timed here.)"""

from __future__ import annotations

import asyncio
import base64
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import cli
from service.api.http_server import BoundedHttpToolsProtocol, uvicorn_options
from service.app import create_app
from service.core.model import Origin
from service.platform.settings import Settings, SettingsError, markdown_table
from service.providers.base import Provider, ProviderEvent, ProviderRequest, TextDelta
from service.providers.fake import FakeProvider
from tests.conftest import ClientFactory
from tests.integration.test_auth import AUDIENCE, ISSUER, SECRET, bearer, claims, hs256, turnstore
from tests.support.database import read_only
from tests.support.fakeapi import FakeResponsesAPI, Script
from tests.support.helpers import CHAT, assert_error, serve

CONVERSATIONS = "/api/v1/conversations"
REPO = Path(__file__).resolve().parents[2]


# --- Medium 1: no-auth mode from a web page ----------------------------------------------


@pytest.mark.parametrize("auth_mode", ["none", "api_key"])
async def test_a_body_that_is_not_declared_json_is_refused(
    make_client: ClientFactory, auth_mode: str, database_url: str
) -> None:
    async with make_client(auth_mode=auth_mode) as client:
        key = await _key(database_url) if auth_mode == "api_key" else None
        headers = bearer(key) if key else {}
        for path in (CHAT, f"{CHAT}/stream"):
            for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                sent = {**headers, **({"Content-Type": content_type} if content_type else {})}
                response = await client.post(path, content=b'{"message": "hi"}', headers=sent)
                assert_error(response, 415, "unsupported_media_type")
        ok = {**headers, "Content-Type": "application/json; charset=utf-8"}
        response = await client.post(CHAT, content=b'{"message": "hi"}', headers=ok)
        assert response.status_code == 200, response.text


async def test_a_body_sent_to_no_route_is_not_found_whatever_its_type(
    client: httpx.AsyncClient,
) -> None:
    """The content-type check is for what a route serves: a path that none serves is 404
    (it was 415, the check running before routing)."""
    for path in ("/api/v1/no-such-route", "/v1/no/such/route", "/nothing"):
        response = await client.post(path, content=b"x=1", headers={"Content-Type": "text/plain"})
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "not_found"
    # A path the router takes as a served one is checked: a trailing or a doubled slash too.
    for served in (CHAT, f"{CHAT}/", "/api/v1//chat", "/api/v1/chat//", "/v1/responses/"):
        refused = await client.post(
            served, content=b'{"message": "csrf"}', headers={"Content-Type": "text/plain"}
        )
        assert refused.status_code == 415, (served, refused.text)


async def _key(database_url: str) -> str:
    from service.app import run_with_api_keys

    return await asyncio.to_thread(
        run_with_api_keys, database_url, lambda keys: keys.create("hardening")
    )


async def test_without_authentication_only_loopback_host_names_are_served(
    make_client: ClientFactory,
) -> None:
    async with make_client() as client:
        for host in ("evil.example", "evil.example:8000", "127.0.0.2", "localhost.evil"):
            response = await client.get(CONVERSATIONS, headers={"Host": host})
            assert_error(response, 400, "invalid_host")
        for host in ("localhost:8000", "127.0.0.1", "[::1]:80", "LOCALHOST."):
            assert (await client.get(CONVERSATIONS, headers={"Host": host})).status_code == 200
        probe = await client.get("/healthz", headers={"Host": "10.1.2.3:8000"})
        assert probe.status_code == 200  # probes carry a pod's address
    async with make_client(allowed_hosts="chat.example, api.example") as client:
        listed = await client.get(CONVERSATIONS, headers={"Host": "chat.example:443"})
        assert listed.status_code == 200
        assert_error(
            await client.get(CONVERSATIONS, headers={"Host": "evil.example"}), 400, "invalid_host"
        )
    async with make_client(auth_mode="api_key") as client:  # credentials protect it instead
        response = await client.get(CONVERSATIONS, headers={"Host": "evil.example"})
        assert_error(response, 401, "unauthorized")


# --- Medium 4: reading a conversation has no size limit ----------------------------------


async def test_a_conversation_is_read_a_page_at_a_time(make_client: ClientFactory) -> None:
    async with make_client() as client:
        cid = None
        for n in range(5):
            body: dict[str, Any] = {"message": f"m{n}", "conversation_id": cid}
            cid = (await client.post(CHAT, json=body)).json()["conversation_id"]
        path = f"{CONVERSATIONS}/{cid}"
        first = await client.get(path, params={"limit": 2})
        assert first.headers["etag"] == '"5"'
        view = first.json()
        assert [t["turn"] for t in view["turns"]] == [1, 2] and view["revision"] == 5
        assert [m["content"] for m in view["messages"]][::2] == ["m0", "m1"]
        assert (view["more_before"], view["more_after"]) == (False, True)
        rest = (await client.get(path, params={"limit": 2, "after": 4})).json()
        assert [t["turn"] for t in rest["turns"]] == [5] and rest["more_after"] is False
        latest = await client.get(path, params={"limit": 2, "before": 6})
        assert latest.headers["etag"] == '"5"'
        assert [t["turn"] for t in latest.json()["turns"]] == [4, 5]
        assert latest.json()["more_before"] is True
        default = (await client.get(path)).json()
        assert len(default["turns"]) == 5  # the default page (50) holds them all
        for bad in ({"limit": 0}, {"limit": 201}, {"after": -1}, {"before": 0}):
            assert_error(await client.get(path, params=bad), 400, "invalid_input")


async def test_a_page_stops_near_a_mebibyte_of_text(make_client: ClientFactory) -> None:
    async with make_client(max_message_chars=400_000, max_body_bytes=2_000_000) as client:
        cid = None
        for n in range(3):  # each turn: ~400 KB asked, ~400 KB echoed back by the fake
            body: dict[str, Any] = {"message": str(n) * 400_000, "conversation_id": cid}
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200, response.text
            cid = response.json()["conversation_id"]
        view = (await client.get(f"{CONVERSATIONS}/{cid}")).json()
        assert [t["turn"] for t in view["turns"]] == [1] and view["more_after"] is True


# --- Medium 5: deleted content survives ------------------------------------------------


async def test_deleting_a_conversation_forgets_its_idempotent_answers(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    async with make_client() as client:
        key = {"Idempotency-Key": "delete-me"}
        first = (await client.post(CHAT, json={"message": "secret"}, headers=key)).json()
        gone = await client.delete(f"{CONVERSATIONS}/{first['conversation_id']}")
        assert gone.status_code == 204
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT * FROM idempotency_keys"))).all()
        assert rows == []
        again = (await client.post(CHAT, json={"message": "secret"}, headers=key)).json()
        assert again["conversation_id"] != first["conversation_id"]  # a new turn, not a replay


async def test_expired_idempotency_records_are_purged_without_retention(
    make_client: ClientFactory,
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with make_client() as client:
        for key in ("old", "new"):
            headers = {"Idempotency-Key": key}
            assert (await client.post(CHAT, json={"message": key}, headers=headers)).is_success
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE idempotency_keys SET expires_at = now() - interval '1 s' WHERE key='old'")
        )
    monkeypatch.delenv("RETENTION_DAYS", raising=False)
    out, _ = await turnstore(["purge"], database_url, monkeypatch, capsys)
    assert "purged 0 conversations" in out
    async with engine.connect() as conn:
        keys = (await conn.execute(text("SELECT key FROM idempotency_keys"))).scalars().all()
    assert keys == ["new"]


# --- Low: one 4xx (or documented limit) each ---------------------------------------------


@pytest.mark.parametrize("tag", ['"\u00b2"', '"' + "9" * 5000 + '"', '"\uff11"', 'W/"1"', '""'])
async def test_odd_if_match_values_fail_the_precondition_instead_of_the_server(
    client: httpx.AsyncClient, tag: str
) -> None:
    cid = (await client.post(CHAT, json={"message": "hi"})).json()["conversation_id"]
    headers = {"If-Match": tag.encode()}  # sent as UTF-8 bytes, as a hostile client may
    body = {"message": "again", "conversation_id": cid}
    assert_error(await client.post(CHAT, json=body, headers=headers), 412, "precondition_failed")
    streamed = await client.post(f"{CHAT}/stream", json=body, headers=headers)
    assert_error(streamed, 412, "precondition_failed")
    deleted = await client.delete(f"{CONVERSATIONS}/{cid}", headers=headers)
    assert_error(deleted, 412, "precondition_failed")


async def test_a_crafted_listing_cursor_is_invalid_input(client: httpx.AsyncClient) -> None:
    far = f"9999-12-31T23:59:59-14:00|{uuid.UUID(int=1)}".encode()
    cursor = base64.urlsafe_b64encode(far).decode().rstrip("=")
    for _ in range(3):  # and no pooled connection thrown away each time
        response = await client.get(CONVERSATIONS, params={"after": cursor})
        assert_error(response, 400, "invalid_input")


async def test_unstorable_or_absurd_provider_replies_are_upstream_errors(
    make_client: ClientFactory, engine: AsyncEngine
) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    api = FakeResponsesAPI().then(
        Script(text="a\u0000b"),
        Script(raw_body=b'{"status":"completed","output":[{"type":"message","content":' + deep + b"}]}"),
    )  # fmt: skip
    async with make_client(provider=api.provider()) as client:
        for _ in range(2):
            response = await client.post(CHAT, json={"message": "hi"})
            assert_error(response, 502, "upstream_error")
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT count(*) FROM conversations")) == 0


@pytest.mark.parametrize("subject", ["a\u0000b", "\ud800", "anonymous", " alice"])
async def test_a_jwt_subject_that_cannot_be_an_owner_is_unauthorized(
    make_client: ClientFactory, subject: str
) -> None:
    settings = {"auth_mode": "jwt", "jwt_secret": SECRET, "jwt_issuer": ISSUER}
    async with make_client(**settings, jwt_audience=AUDIENCE) as client:
        token = hs256(claims(sub=subject))
        response = await client.post(CHAT, json={"message": "hi"}, headers=bearer(token))
        assert_error(response, 401, "unauthorized")


def test_credentials_in_the_provider_url_are_refused_and_request_lines_not_logged() -> None:
    with pytest.raises(SettingsError, match="OPENAI_BASE_URL"):
        Settings.from_env({"OPENAI_BASE_URL": "https://user:sk-secret@proxy.example/v1"})
    from service.platform.logs import configure

    configure("json")
    import logging

    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)


async def test_readiness_and_recovery_follow_a_read_only_database(
    make_client: ClientFactory, server_url: str, database_url: str
) -> None:
    database = database_url.rsplit("/", 1)[1].split("?")[0]
    async with make_client() as client:
        cid = (await client.post(CHAT, json={"message": "start"})).json()["conversation_id"]
        async with read_only(server_url, database):
            assert_error(await client.get("/readyz"), 503, "not_ready")
            # Reads work on read-only sessions: the pool fills with them.
            reads = [client.get(f"{CONVERSATIONS}/{cid}") for _ in range(6)]
            assert all(r.status_code == 200 for r in await asyncio.gather(*reads))
        # Writable again: the very first turn succeeds, and the replica is ready.
        turn = await client.post(CHAT, json={"message": "again", "conversation_id": cid})
        assert turn.status_code == 200, turn.text
        assert (await client.get("/readyz")).status_code == 200


@asynccontextmanager
async def bounded_server(
    database_url: str, head_timeout_s: float, **settings: Any
) -> AsyncIterator[tuple[str, int]]:
    """The app under uvicorn with `turnstore serve`'s protocol; (host, port)."""
    config = Settings(database_url=database_url, **settings)
    options = {**uvicorn_options(config), "http": _fast_head_protocol(head_timeout_s)}
    async with serve(create_app(config, provider=FakeProvider()), **options) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def _fast_head_protocol(timeout: float) -> type[BoundedHttpToolsProtocol]:
    class Fast(BoundedHttpToolsProtocol):
        head_timeout_s = timeout

    return Fast


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(65536), timeout=10)


async def test_slow_or_idle_clients_are_cut_off(database_url: str) -> None:
    async with bounded_server(database_url, 0.3, http_keepalive_s=0.3) as (host, port):
        # A request head trickling in: 408 in the envelope, connection closed.
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        answer = await _read_all(reader)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"code": "invalid_input"' in answer and await reader.read() == b""
        writer.close()
        # A connection that never sends anything is closed too.
        reader, writer = await asyncio.open_connection(host, port)
        assert (await _read_all(reader)).startswith(b"HTTP/1.1 408")
        writer.close()
        # An idle kept-alive connection is closed after HTTP_KEEPALIVE_S.
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (await _read_all(reader)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed by the server
        writer.close()


async def test_the_servers_own_400_is_in_the_envelope(database_url: str) -> None:
    async with bounded_server(database_url, 5) as (host, port):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        answer = await _read_all(reader)
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
    assert b'"code": "invalid_input"' in body and b"x-correlation-id" in head


async def test_a_repeated_idempotency_key_header_is_refused(client: httpx.AsyncClient) -> None:
    headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    for path in (CHAT, f"{CHAT}/stream"):
        response = await client.post(path, json={"message": "hi"}, headers=headers)
        assert_error(response, 400, "invalid_input")


def _counted(metrics: str, line_start: str) -> float:
    return sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(line_start)
    )


async def test_a_committed_stream_is_not_counted_as_a_disconnect(client: httpx.AsyncClient) -> None:
    disconnects = 'turnstore_turns_not_committed_total{mode="stream",reason="disconnect"}'
    committed = 'turnstore_turns_committed_total{mode="stream"}'
    before = (await client.get("/metrics")).text
    streamed = await client.post(f"{CHAT}/stream", json={"message": "hi"})
    assert "event: message.done" in streamed.text
    after = (await client.get("/metrics")).text
    assert _counted(after, committed) == _counted(before, committed) + 1
    assert _counted(after, disconnects) == _counted(before, disconnects)


class EndlessSecondCall(Provider):
    """Answers its first request like the fake; then streams text for ever."""

    origin = Origin("endless", "memory", "m")

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self._fake = FakeProvider()
        self._calls = 0

    async def respond(
        self, request: ProviderRequest, *, stream: bool
    ) -> AsyncGenerator[ProviderEvent, None]:
        self._calls += 1
        if self._calls != 2:
            async for event in self._fake.respond(request, stream=stream):
                yield event
            return
        try:
            while True:
                yield TextDelta("x" * 65536)
                await asyncio.sleep(0)
        finally:
            self.closed.set()

    async def close(self) -> None:
        return None


async def test_a_client_that_stops_reading_frees_its_turn_and_conversation(
    make_client: ClientFactory,
) -> None:
    provider = EndlessSecondCall()
    async with make_client(provider=provider, client_send_timeout_s=0.5) as client:
        cid = (await client.post(CHAT, json={"message": "one"})).json()["conversation_id"]
        host, port = str(client.base_url.host), int(client.base_url.port or 80)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await asyncio.to_thread(sock.connect, (host, port))
        body = f'{{"message": "two", "conversation_id": "{cid}"}}'.encode()
        head = (
            f"POST {CHAT}/stream HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)  # and never reads a byte of the answer
        try:
            await asyncio.wait_for(provider.closed.wait(), timeout=30)
            third = await client.post(CHAT, json={"message": "three", "conversation_id": cid})
            assert third.status_code == 200 and third.json()["revision"] == 2, third.text
        finally:
            sock.close()


async def test_api_keys_are_revoked_by_id_owner_or_standard_input_and_anonymous_is_reserved(
    make_client: ClientFactory,
    database_url: str,
    engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def create(owner: str) -> tuple[str, str]:
        out, err = await turnstore(
            ["keys", "create", "--owner", owner], database_url, monkeypatch, capsys
        )
        return out.splitlines()[-1], err.split("(id ")[1].split(")")[0]

    (by_id, its_id), (by_stdin, _), (erin1, _), (erin2, _) = [
        await create(owner) for owner in ("ivy", "sam", "erin", "erin")
    ]
    await turnstore(["keys", "revoke", "--id", its_id], database_url, monkeypatch, capsys)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(by_stdin + "\n"))
    await turnstore(["keys", "revoke", "-"], database_url, monkeypatch, capsys)
    _, err = await turnstore(
        ["keys", "revoke", "--owner", "erin"], database_url, monkeypatch, capsys
    )
    assert err.count(",") == 1  # both of erin's keys
    with pytest.raises(SystemExit):
        await turnstore(
            ["keys", "create", "--owner", "anonymous"], database_url, monkeypatch, capsys
        )
    planted = "ts_" + "A" * 43  # a key for the anonymous owner, made before it was reserved
    from service.core.model import key_hash

    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO api_keys (key_hash, owner) VALUES (:h, 'anonymous')"),
            {"h": key_hash(planted)},
        )
    async with make_client(auth_mode="api_key") as client:
        for key in (by_id, by_stdin, erin1, erin2, planted):
            response = await client.get(CONVERSATIONS, headers=bearer(key))
            assert_error(response, 401, "unauthorized")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SSE_KEEPALIVE_S", "0"),
        ("TOOL_TIMEOUT_S", "0"),
        ("DB_POOL_SIZE", "0"),
        ("MAX_BODY_BYTES", "0"),
        ("UPSTREAM_READ_TIMEOUT_S", "soon"),
        ("AUTH_MODE", "maybe"),
    ],
)
def test_every_setting_is_checked_at_start_up(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve"])
    assert stopped.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"turnstore: {variable} must be") and "\n" not in line
    from service import app

    app._app_from_environment.cache_clear()
    with pytest.raises(SystemExit) as asgi:
        app.__getattr__("app")  # `uvicorn service.app:app` stops the same way
    assert asgi.value.code == 2


def test_the_readme_configuration_table_is_generated_from_the_settings() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- settings:begin -->\n", 1)[1].split("\n<!-- settings:end -->", 1)[0]
    assert table == markdown_table()
    assert "2 x DB_POOL_SIZE" not in readme


async def test_the_openapi_document_says_what_the_server_enforces(
    client: httpx.AsyncClient,
) -> None:
    schema = (await client.get("/schema/openapi.json")).json()["components"]["schemas"]
    request = schema["ChatRequest"]
    assert request["additionalProperties"] is False
    assert request["properties"]["message"]["minLength"] == 1
