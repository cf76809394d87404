"""Who is calling: the ``owner`` of every request, decided by AUTH_MODE.

none     every caller is the one owner ``anonymous`` (refused off loopback unless explicit)
api_key  ``Authorization: Bearer ts_...``, looked up by its SHA-256 on every request
         (service/store/postgres/keys.py), so a revoked key is refused by every replica at once
jwt      ``Authorization: Bearer <JWT>``: HS256 with JWT_SECRET(_FILE), or RS256 with the
         public key(s) in JWT_PUBLIC_KEY_FILE. The configuration picks the algorithm, never the
         token; exp, iss, aud and sub are required; the owner is ``sub``.

A refusal is Unauthorized; its message never echoes the credential or a verifier's text.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import Components, SecurityRequirement, SecurityScheme
from litestar.types import Guard

from service.core.errors import Unauthorized
from service.core.model import ANONYMOUS, is_owner_name
from service.platform.settings import Settings
from service.store.ports import ApiKeys

Connection = ASGIConnection[Any, Any, Any, Any]
Authenticator = Callable[[Connection], Awaitable[str]]
OwnerDependency = Callable[[Request[Any, Any, Any]], Awaitable[str]]

LEEWAY_S = 30  # clock skew tolerated on exp / nbf / iat
_INVALID = "The credentials are invalid."
_OWNER_KEY = "turnstore.owner"
_REQUIRED_CLAIMS = ["exp", "iss", "aud", "sub"]
_PEM_BLOCK = re.compile(
    rb"-----BEGIN (PUBLIC KEY|RSA PUBLIC KEY|CERTIFICATE)-----.+?-----END \1-----", re.S
)


def bearer_token(request: Connection) -> str:
    """The one ``Authorization: Bearer`` credential of the request."""
    values = request.headers.getall("authorization", [])
    if not values:
        raise Unauthorized()
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthorized()  # another scheme: no bearer credential was sent
    token = token.strip()
    if len(values) > 1 or not token:
        raise Unauthorized(_INVALID, token_sent=True)
    return token


@dataclass(frozen=True)
class JWTVerifier:
    algorithm: str
    keys: tuple[Any, ...]  # several public keys: rotation (the first that verifies wins)
    issuer: str
    audience: str

    def owner(self, token: str) -> str:
        for i, key in enumerate(self.keys):
            try:
                claims = jwt.decode(
                    token,
                    key,
                    algorithms=[self.algorithm],
                    issuer=self.issuer,
                    audience=self.audience,
                    leeway=LEEWAY_S,
                    options={"require": _REQUIRED_CLAIMS, "enforce_minimum_key_length": True},
                )
            except jwt.InvalidSignatureError:
                if i + 1 < len(self.keys):
                    continue
                raise Unauthorized(_INVALID, token_sent=True) from None
            except jwt.ExpiredSignatureError:
                raise Unauthorized("The token has expired.", token_sent=True) from None
            except (jwt.PyJWTError, ValueError):
                raise Unauthorized(_INVALID, token_sent=True) from None
            subject = claims.get("sub")
            if not is_owner_name(subject):
                break
            return str(subject)
        raise Unauthorized(_INVALID, token_sent=True)


def _rsa_public_keys(path: Path) -> tuple[RSAPublicKey, ...]:
    keys: list[RSAPublicKey] = []
    for block in _PEM_BLOCK.finditer(path.read_bytes()):
        if block.group(1) == b"CERTIFICATE":
            key: object = x509.load_pem_x509_certificate(block.group(0)).public_key()
        else:
            key = load_pem_public_key(block.group(0))
        if not isinstance(key, RSAPublicKey) or key.key_size < 2048:
            raise ValueError("JWT_PUBLIC_KEY_FILE: every key must be an RSA key of >= 2048 bits")
        keys.append(key)
    if not keys:
        raise ValueError("JWT_PUBLIC_KEY_FILE holds no PEM public key or certificate")
    return tuple(keys)


def jwt_verifier(settings: Settings) -> JWTVerifier:
    """The verifier the settings describe; ValueError (naming variables, never values) when
    they are incomplete or ambiguous."""
    if not settings.jwt_issuer or not settings.jwt_audience:
        raise ValueError("AUTH_MODE=jwt needs JWT_ISSUER and JWT_AUDIENCE")
    sources = [settings.jwt_secret, settings.jwt_secret_file, settings.jwt_public_key_file]
    if sum(source is not None for source in sources) != 1:
        raise ValueError(
            "AUTH_MODE=jwt needs exactly one of JWT_SECRET, JWT_SECRET_FILE (HS256) or "
            "JWT_PUBLIC_KEY_FILE (RS256)"
        )
    keys: tuple[Any, ...]
    if settings.jwt_public_key_file is not None:
        algorithm, keys = "RS256", _rsa_public_keys(settings.jwt_public_key_file)
    else:
        secret = settings.jwt_secret
        if settings.jwt_secret_file is not None:
            secret = settings.jwt_secret_file.read_text(encoding="utf-8").rstrip("\r\n")
        assert secret is not None
        if len(secret.encode()) < 32:  # RFC 7518 3.2: at least the hash's size
            raise ValueError("the HS256 secret (JWT_SECRET or JWT_SECRET_FILE) needs >= 32 bytes")
        algorithm, keys = "HS256", (secret.encode(),)
    return JWTVerifier(algorithm, keys, settings.jwt_issuer, settings.jwt_audience)


def build_authenticator(settings: Settings, api_keys: ApiKeys | None) -> Authenticator:
    """``async (connection) -> owner``, or Unauthorized."""
    if settings.auth_mode == "none":

        async def anonymous(request: Connection) -> str:
            return ANONYMOUS

        return anonymous

    if settings.auth_mode == "api_key":
        if api_keys is None:
            raise ValueError("AUTH_MODE=api_key needs the database that holds the keys")
        keys = api_keys

        async def by_api_key(request: Connection) -> str:
            owner = await keys.owner_of(bearer_token(request))
            if owner is None:
                raise Unauthorized(_INVALID, token_sent=True)
            return owner

        return by_api_key

    if settings.auth_mode == "jwt":
        verifier = jwt_verifier(settings)

        async def by_jwt(request: Connection) -> str:
            return verifier.owner(bearer_token(request))

        return by_jwt

    raise ValueError(f"unknown AUTH_MODE {settings.auth_mode!r}")


def authentication(authenticator: Authenticator) -> tuple[Guard, OwnerDependency]:
    """A guard for the routes that have an owner, and the ``owner`` dependency. The guard runs
    before the body is read or validated, so an unauthenticated request costs no parsing and
    is 401 whatever it sent; the dependency hands its result to the handler."""

    async def guard(connection: Connection, _: BaseRouteHandler) -> None:
        connection.scope.setdefault("state", {})[_OWNER_KEY] = await authenticator(connection)

    async def owner(request: Request[Any, Any, Any]) -> str:
        known = request.scope.get("state", {}).get(_OWNER_KEY)
        return known if isinstance(known, str) else await authenticator(request)

    return guard, owner


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def check_serving(settings: Settings, host: str, *, none_is_explicit: bool) -> None:
    """Refuse (ValueError) to serve without authentication beyond loopback unless the
    operator said AUTH_MODE=none; and fail early on an incomplete JWT configuration."""
    if settings.auth_mode == "none" and not is_loopback(host) and not none_is_explicit:
        raise ValueError(
            f"refusing to serve on {host} without authentication: set AUTH_MODE=api_key or "
            "AUTH_MODE=jwt, or AUTH_MODE=none explicitly to allow anonymous access"
        )
    if settings.auth_mode == "jwt":
        jwt_verifier(settings)


def openapi_security(settings: Settings) -> tuple[Components, list[SecurityRequirement]]:
    """The OpenAPI security scheme, and the requirement for the operations that have an owner
    (none for AUTH_MODE=none; /healthz, /readyz, /metrics and /schema never need one)."""
    if settings.auth_mode == "none":
        return Components(), []
    what = "an API key (turnstore keys create)" if settings.auth_mode == "api_key" else "a JWT"
    scheme = SecurityScheme(
        type="http",
        scheme="bearer",
        bearer_format="JWT" if settings.auth_mode == "jwt" else None,
        description=f"`Authorization: Bearer <{what}>`; missing or wrong: 401 unauthorized.",
    )
    return Components(security_schemes={"bearer": scheme}), [{"bearer": []}]
