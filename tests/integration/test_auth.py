"""Authentication over real HTTP against real PostgreSQL: API keys made and revoked with the
real `turnstore keys` command, JWTs (HS256 and RS256), and the refusal to serve anonymously
beyond loopback. No secret may appear in a response or a log line."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import cli
from service.api.auth import check_serving, is_loopback, jwt_verifier
from service.api.http_server import uvicorn_options
from service.platform.logs import JSONFormatter
from service.platform.settings import Settings
from service.store.postgres import ApiKeyStore
from tests.conftest import ClientFactory
from tests.support.helpers import CHAT, assert_error

CONVERSATIONS = "/api/v1/conversations"
SECRET = "s3cr3t-hs256-" + "x" * 40  # >= 32 bytes
ISSUER, AUDIENCE = "https://issuer.test", "turnstore-test"
CHALLENGE = 'Bearer realm="turnstore"'
INVALID_TOKEN = 'Bearer realm="turnstore", error="invalid_token"'


class Seen:
    """Every response body and header value and every log line of a test, to prove that no
    secret ever shows up in them."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.records: list[logging.LogRecord] = []

    def response(self, response: httpx.Response) -> httpx.Response:
        self.texts.append(response.text)
        self.texts.extend(f"{k}: {v}" for k, v in response.headers.items())
        return response

    def assert_never(self, *secrets: str) -> None:
        lines = self.texts + [JSONFormatter().format(record) for record in self.records]
        assert lines
        for secret in secrets:
            assert not any(secret in line for line in lines), secret


@pytest.fixture
def seen() -> Iterator[Seen]:
    seen = Seen()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.records.append(record)

    handler = Keep(logging.DEBUG)
    loggers = [
        logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield seen
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def logging_kept() -> Iterator[None]:
    """`turnstore` configures logging for its process; keep the test process's set-up."""
    loggers = [
        logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")
    ]
    kept = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    try:
        yield
    finally:
        for logger, (handlers, level, propagate) in zip(loggers, kept, strict=True):
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


async def turnstore(
    argv: list[str], database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> tuple[str, str]:
    """Run the real `turnstore` command against the test database; (stdout, stderr)."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    capsys.readouterr()
    with logging_kept():
        await asyncio.to_thread(cli.main, argv)
    captured = capsys.readouterr()
    return captured.out, captured.err


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"sub": "alice", "iss": ISSUER, "aud": AUDIENCE, "exp": now + 300, "iat": now}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def hs256(payload: dict[str, Any], secret: str | bytes = SECRET, alg: str = "HS256") -> str:
    """Signed by hand, so a test can sign with anything (PyJWT refuses PEM keys as secrets)."""
    header = b64(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    body = b64(json.dumps(payload).encode())
    key = secret.encode() if isinstance(secret, str) else secret
    digest = {"HS256": hashlib.sha256, "HS512": hashlib.sha512}[alg]
    signature = hmac.new(key, f"{header}.{body}".encode(), digest).digest()
    return f"{header}.{body}.{b64(signature)}"


def unsigned(payload: dict[str, Any]) -> str:
    header = b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{b64(json.dumps(payload).encode())}."


async def start_and_read(client: httpx.AsyncClient, headers: dict[str, str], seen: Seen) -> str:
    """A turn and a read of it with these credentials; the conversation id."""
    response = seen.response(await client.post(CHAT, json={"message": "hi"}, headers=headers))
    assert response.status_code == 200, response.text
    cid = str(response.json()["conversation_id"])
    read = seen.response(await client.get(f"{CONVERSATIONS}/{cid}", headers=headers))
    assert read.status_code == 200, read.text
    return cid


def assert_unauthorized(response: httpx.Response, challenge: str = INVALID_TOKEN) -> None:
    assert_error(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == challenge


# --- API keys -----------------------------------------------------------------------------


async def test_api_keys_from_the_cli_and_revocation_on_every_replica(
    make_client: ClientFactory,
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    seen: Seen,
) -> None:
    out, _ = await turnstore(
        ["keys", "create", "--owner", "alice"], database_url, monkeypatch, capsys
    )
    alice = out.splitlines()[-1]
    assert alice.startswith("ts_") and len(alice) == 46 and alice == alice.strip()
    out, _ = await turnstore(
        ["keys", "create", "--owner", "bob"], database_url, monkeypatch, capsys
    )
    bob = out.splitlines()[-1]
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT key_hash, owner FROM api_keys"))).all()
    stored = {row.key_hash: row.owner for row in rows}
    assert stored[hashlib.sha256(alice.encode()).hexdigest()] == "alice"
    assert not any(alice in row.key_hash or bob in row.key_hash for row in rows)

    async with (
        make_client(auth_mode="api_key") as one,
        make_client(auth_mode="api_key") as two,
    ):
        for client in (one, two):
            no_key = seen.response(await client.post(CHAT, json={"message": "hi"}))
            assert_unauthorized(no_key, CHALLENGE)
            wrong = seen.response(
                await client.post(CHAT, json={"message": "hi"}, headers=bearer("ts_" + "A" * 43))
            )
            assert_unauthorized(wrong)
            garbage = seen.response(await client.get(f"{CONVERSATIONS}/x", headers=bearer("x")))
            assert_unauthorized(garbage)
            basic = seen.response(
                await client.get(CONVERSATIONS, headers={"Authorization": "Basic YTpi"})
            )
            assert_unauthorized(basic, CHALLENGE)
            twice = seen.response(
                await client.get(
                    CONVERSATIONS,
                    headers=[("Authorization", f"Bearer {alice}"), ("Authorization", "Bearer x")],
                )
            )
            assert_unauthorized(twice)

        cid = await start_and_read(one, bearer(alice), seen)
        again = await two.get(f"{CONVERSATIONS}/{cid}", headers=bearer(alice))
        assert seen.response(again).status_code == 200
        # The scheme name is case-insensitive (RFC 7235).
        lower = await two.get(
            f"{CONVERSATIONS}/{cid}", headers={"Authorization": f"bearer {alice}"}
        )
        assert seen.response(lower).status_code == 200
        others = seen.response(await two.get(f"{CONVERSATIONS}/{cid}", headers=bearer(bob)))
        assert_error(others, 404, "conversation_not_found")

        await turnstore(["keys", "revoke", alice], database_url, monkeypatch, capsys)
        for client in (one, two):  # no cache anywhere: refused from the next request on
            response = seen.response(
                await client.get(f"{CONVERSATIONS}/{cid}", headers=bearer(alice))
            )
            assert_unauthorized(response)
            chat = seen.response(
                await client.post(CHAT, json={"message": "hi"}, headers=bearer(alice))
            )
            assert_unauthorized(chat)
        still = seen.response(await one.get(CONVERSATIONS, headers=bearer(bob)))
        assert still.status_code == 200

    seen.assert_never(alice, bob)


async def test_credentials_are_checked_first_and_once(
    make_client: ClientFactory,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before the body is read (401, not 400, for junk without credentials), and with one
    key lookup per request."""
    out, _ = await turnstore(
        ["keys", "create", "--owner", "dora"], database_url, monkeypatch, capsys
    )
    key = out.splitlines()[-1]
    lookups: list[str] = []
    real = ApiKeyStore.owner_of

    async def counted(self: ApiKeyStore, presented: str) -> str | None:
        lookups.append(presented)
        return await real(self, presented)

    monkeypatch.setattr(ApiKeyStore, "owner_of", counted)
    async with make_client(auth_mode="api_key") as client:
        junk = await client.post(
            CHAT, content=b'{"message": NaN', headers={"Content-Type": "application/json"}
        )
        assert_unauthorized(junk, CHALLENGE)
        assert (
            await client.post(CHAT, json={"message": "hi"}, headers=bearer(key))
        ).status_code == 200
        assert len(lookups) == 1
        bad = await client.post(
            CHAT, content=b"{", headers={**bearer(key), "Content-Type": "application/json"}
        )
        assert_error(bad, 400, "invalid_input")


async def test_keys_cli_rejects_unknown_keys_and_bad_owners(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as unknown:
        await turnstore(["keys", "revoke", "ts_" + "B" * 43], database_url, monkeypatch, capsys)
    assert unknown.value.code not in (0, None)
    with pytest.raises(SystemExit) as bad_owner:
        await turnstore(["keys", "create", "--owner", "a\nb"], database_url, monkeypatch, capsys)
    assert bad_owner.value.code not in (0, None)
    out, _ = await turnstore(
        ["keys", "create", "--owner", "carol"], database_url, monkeypatch, capsys
    )
    key = out.splitlines()[-1]
    await turnstore(["keys", "revoke", key], database_url, monkeypatch, capsys)
    await turnstore(["keys", "revoke", key], database_url, monkeypatch, capsys)  # idempotent


async def test_operations_and_the_schema_need_no_credentials(make_client: ClientFactory) -> None:
    async with make_client(auth_mode="api_key") as client:
        for path in ("/healthz", "/readyz", "/metrics", "/schema/openapi.json"):
            assert (await client.get(path)).status_code == 200, path
        schema = (await client.get("/schema/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "security" not in schema  # per operation: only those with an owner need credentials
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            expected = [{"bearer": []}] if path.startswith(("/api/", "/v1/")) else None
            assert operation.get("security") == expected, path


# --- JWT -----------------------------------------------------------------------------------


def jwt_settings(**extra: Any) -> dict[str, Any]:
    return {"auth_mode": "jwt", "jwt_issuer": ISSUER, "jwt_audience": AUDIENCE, **extra}


async def test_hs256_tokens(make_client: ClientFactory, seen: Seen) -> None:
    valid = jwt.encode(claims(), SECRET, algorithm="HS256")
    refused = {
        "expired": jwt.encode(claims(exp=int(time.time()) - 120), SECRET, algorithm="HS256"),
        "wrong issuer": jwt.encode(claims(iss="https://evil.test"), SECRET, algorithm="HS256"),
        "wrong audience": jwt.encode(claims(aud="someone-else"), SECRET, algorithm="HS256"),
        "no sub": jwt.encode(claims(sub=None), SECRET, algorithm="HS256"),
        "empty sub": jwt.encode(claims(sub=""), SECRET, algorithm="HS256"),
        "no exp": jwt.encode(claims(exp=None), SECRET, algorithm="HS256"),
        "no iss": jwt.encode(claims(iss=None), SECRET, algorithm="HS256"),
        "no aud": jwt.encode(claims(aud=None), SECRET, algorithm="HS256"),
        "not yet valid": jwt.encode(claims(nbf=int(time.time()) + 600), SECRET, algorithm="HS256"),
        "alg none": unsigned(claims()),
        "alg none, signed": unsigned(claims()) + b64(b"sig"),
        "HS512, same secret": hs256(claims(), alg="HS512"),
        "wrong key": jwt.encode(claims(), "another-secret-" + "y" * 40, algorithm="HS256"),
        "tampered sub": valid.split(".")[0]
        + "."
        + b64(json.dumps(claims(sub="mallory")).encode())
        + "."
        + valid.split(".")[2],
        "not a JWT": "not.a.jwt",
        "garbage": "~!@#$%^&*()",
    }
    async with make_client(**jwt_settings(jwt_secret=SECRET)) as client:
        cid = await start_and_read(client, bearer(valid), seen)
        other = jwt.encode(claims(sub="bob"), SECRET, algorithm="HS256")
        not_bobs = await client.get(f"{CONVERSATIONS}/{cid}", headers=bearer(other))
        assert_error(seen.response(not_bobs), 404, "conversation_not_found")
        for what, token in refused.items():
            response = seen.response(
                await client.post(CHAT, json={"message": "hi"}, headers=bearer(token))
            )
            assert response.status_code == 401, what
            assert_unauthorized(response)
            assert token not in response.text
        latin1 = await client.get(
            CONVERSATIONS, headers={"Authorization": b"Bearer \xe9t\xe9.\xff.x"}
        )
        assert_unauthorized(seen.response(latin1))
        expired = seen.response(await client.get(CONVERSATIONS, headers=bearer(refused["expired"])))
        assert "expired" in expired.json()["error"]["message"]
        # Within the leeway, a just-expired token still counts (clock skew between hosts).
        skewed = jwt.encode(claims(exp=int(time.time()) - 5), SECRET, algorithm="HS256")
        assert (
            seen.response(await client.get(CONVERSATIONS, headers=bearer(skewed))).status_code
            == 200
        )
        missing = seen.response(await client.get(CONVERSATIONS))
        assert_unauthorized(missing, CHALLENGE)
    seen.assert_never(SECRET, valid, *refused.values())


async def test_hs256_secret_from_a_file(make_client: ClientFactory, tmp_path: Path) -> None:
    path = tmp_path / "jwt-secret"
    path.write_text(SECRET + "\n")
    async with make_client(**jwt_settings(jwt_secret_file=path)) as client:
        token = jwt.encode(claims(), SECRET, algorithm="HS256")
        assert (await client.get(CONVERSATIONS, headers=bearer(token))).status_code == 200


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


async def test_rs256_tokens_with_key_rotation(
    make_client: ClientFactory, tmp_path: Path, seen: Seen
) -> None:
    old, new, stranger = rsa_key(), rsa_key(), rsa_key()
    path = tmp_path / "jwt-public.pem"
    path.write_bytes(public_pem(old) + public_pem(new))  # both accepted during a rotation
    by_old = jwt.encode(claims(), old, algorithm="RS256")
    by_new = jwt.encode(claims(sub="bob"), new, algorithm="RS256")
    refused = {
        "unknown key": jwt.encode(claims(), stranger, algorithm="RS256"),
        "expired": jwt.encode(claims(exp=int(time.time()) - 120), new, algorithm="RS256"),
        "wrong audience": jwt.encode(claims(aud="x"), new, algorithm="RS256"),
        # The classic confusion: HMAC keyed with the public key the server verifies with.
        "HS256 with the public key": hs256(claims(), secret=public_pem(new)),
        "alg none": unsigned(claims()),
    }
    async with make_client(**jwt_settings(jwt_public_key_file=path)) as client:
        await start_and_read(client, bearer(by_old), seen)
        await start_and_read(client, bearer(by_new), seen)
        for what, token in refused.items():
            response = seen.response(await client.get(CONVERSATIONS, headers=bearer(token)))
            assert response.status_code == 401, what
            assert_unauthorized(response)


def test_incomplete_or_weak_jwt_configuration_is_refused(tmp_path: Path) -> None:
    short = "too-short-secret"
    cases = [
        Settings(auth_mode="jwt", jwt_secret=SECRET, jwt_audience=AUDIENCE),
        Settings(auth_mode="jwt", jwt_secret=SECRET, jwt_issuer=ISSUER),
        Settings(auth_mode="jwt", jwt_issuer=ISSUER, jwt_audience=AUDIENCE),
        Settings(**jwt_settings(jwt_secret=short)),
        Settings(**jwt_settings(jwt_secret=SECRET, jwt_public_key_file=tmp_path / "k.pem")),
    ]
    weak = tmp_path / "weak.pem"
    weak_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak.write_bytes(public_pem(weak_key))
    empty = tmp_path / "empty.pem"
    empty.write_text("nothing here\n")
    cases += [Settings(**jwt_settings(jwt_public_key_file=p)) for p in (weak, empty)]
    for settings in cases:
        with pytest.raises(ValueError) as raised:
            jwt_verifier(settings)
        assert SECRET not in str(raised.value) and short not in str(raised.value)
        assert SECRET not in repr(settings) and short not in repr(settings)


def test_settings_from_the_environment() -> None:
    settings = Settings.from_env(
        {"AUTH_MODE": "JWT", "JWT_SECRET": SECRET, "JWT_ISSUER": ISSUER, "JWT_AUDIENCE": AUDIENCE}
    )
    assert settings.auth_mode == "jwt" and jwt_verifier(settings).algorithm == "HS256"
    assert Settings.from_env({}).auth_mode == "none"
    with pytest.raises(ValueError):
        Settings.from_env({"AUTH_MODE": "basic"})


# --- serving anonymously beyond loopback ----------------------------------------------------


def test_loopback_hosts() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com", ""))
    check_serving(Settings(), "127.0.0.1", none_is_explicit=False)
    check_serving(Settings(), "0.0.0.0", none_is_explicit=True)
    check_serving(Settings(auth_mode="api_key"), "0.0.0.0", none_is_explicit=False)
    with pytest.raises(ValueError, match="AUTH_MODE"):
        check_serving(Settings(), "0.0.0.0", none_is_explicit=False)


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({}, "refusing to serve on 0.0.0.0"),
        ({"AUTH_MODE": ""}, "refusing to serve on 0.0.0.0"),
        ({"AUTH_MODE": "jwt", "JWT_SECRET": SECRET}, "JWT_ISSUER"),
    ],
)
def test_serve_refuses_to_start(
    env: dict[str, str], refused: str, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    import uvicorn

    def must_not_serve(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("turnstore serve started")

    monkeypatch.setattr(uvicorn, "run", must_not_serve)
    monkeypatch.setenv("DATABASE_URL", database_url)
    for name in ("AUTH_MODE", "JWT_SECRET", "JWT_ISSUER", "JWT_AUDIENCE", "JWT_PUBLIC_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with logging_kept(), pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--host", "0.0.0.0", "--port", "0"])
    assert isinstance(exited.value.code, str) and refused in exited.value.code
    assert SECRET not in exited.value.code


def test_serve_with_explicit_none_starts(
    monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    import uvicorn

    served: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.update(kwargs))
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("AUTH_MODE", "none")
    with logging_kept():
        cli.main(["serve", "--host", "0.0.0.0", "--port", "0"])
    assert served["host"] == "0.0.0.0"
    assert served["http"] is uvicorn_options(Settings())["http"]
    assert served["h11_max_incomplete_event_size"] == 16 * 1024
