"""What a route's decorator says besides its method and path, built in one place for both
surfaces: its summary, the errors it documents (in the surface's error shape), its response
headers and, for a body, its strict decoding before the framework reads it
(service/api/bodies.py). ``@post("/", **openai_route("Create it.", Full, body=Create))``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import msgspec
from litestar import Controller
from litestar.datastructures import ResponseHeader
from litestar.openapi.datastructures import ResponseSpec
from litestar.types import BeforeRequestHookHandler

from service.api.bodies import strict
from service.api.errors import documented, openai_documented
from service.api.headers import CORRELATION_ID, ETAG
from service.core.errors import TurnstoreError


class Resource(Controller):
    """The routes of one resource (its ``path``), tagged in OpenAPI by their surface: on /api/v1
    by the resource (``/api/v1/turns``: turns), on the OpenAI surface (``/v1/...``) as openai."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tags = ["openai"] if cls.path.startswith("/v1/") else [cls.path.rsplit("/", 1)[-1]]


class RouteArgs(TypedDict):
    """The route decorator's keyword arguments."""

    status_code: int | None
    summary: str
    description: str | None
    before_request: BeforeRequestHookHandler | None
    response_headers: Sequence[ResponseHeader]
    responses: Mapping[int, ResponseSpec]


def route(
    summary: str,
    *errors: type[TurnstoreError],
    body: type[msgspec.Struct] | None = None,
    etag: bool = False,
    status_code: int | None = None,
    description: str | None = None,
) -> RouteArgs:
    """A /api/v1 route that may answer ``errors`` (in the contract's envelope), with the
    response's ETag when ``etag``."""
    return _args(summary, documented(*errors), body, etag, status_code, description)


def openai_route(
    summary: str,
    *errors: type[TurnstoreError],
    body: type[msgspec.Struct] | None = None,
    etag: bool = False,
    description: str | None = None,
) -> RouteArgs:
    """A /v1 route: 200 whatever its method (as OpenAI answers), ``errors`` besides those
    every /v1 route may answer, in OpenAI's error shape."""
    return _args(summary, openai_documented(*errors), body, etag, 200, description)


def _args(
    summary: str,
    responses: Mapping[int, ResponseSpec],
    body: type[msgspec.Struct] | None,
    etag: bool,
    status_code: int | None,
    description: str | None,
) -> RouteArgs:
    return RouteArgs(
        status_code=status_code,
        summary=summary,
        description=description,
        before_request=strict(body) if body else None,
        response_headers=[ETAG, CORRELATION_ID] if etag else [CORRELATION_ID],
        responses=responses,
    )
