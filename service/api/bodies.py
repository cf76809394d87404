"""Request bodies decoded strictly, in one place for both surfaces.

msgspec decodes the body in C into its struct (unknown fields refused, a hostile body refused
at its first wrong byte); then duplicate keys, which msgspec would silently resolve, are
refused too. A refusal names the field at fault (``param``), as OpenAI's errors do.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request

from service.core.errors import InvalidInput
from service.core.strictjson import StrictJSONError, loads

S = TypeVar("S", bound=msgspec.Struct)
_AT = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


class StrictRequest(Request[Any, Any, Any]):
    """The app's request class: a body a ``before_request`` hook decoded (``strict``) is the
    handler's ``data`` as it is, not parsed again by the framework (into Python objects, then
    converted into the struct once more)."""

    __slots__ = ("_strict",)

    def keep(self, value: msgspec.Struct) -> None:
        self._strict = value

    async def json(self) -> Any:
        try:
            return self._strict
        except AttributeError:
            return await super().json()


def strict(into: type[msgspec.Struct]) -> Callable[[Request[Any, Any, Any]], Awaitable[None]]:
    """A ``before_request`` hook: the body decodes into ``into`` (400 naming the field at
    fault otherwise) before the framework parses it for the handler, which gets that value."""

    async def check(request: Request[Any, Any, Any]) -> None:
        decoded(request, decode(await request.body(), into))

    return check


def decoded(request: Request[Any, Any, Any], value: msgspec.Struct) -> None:
    """``value`` is the handler's ``data``."""
    if isinstance(request, StrictRequest):
        request.keep(value)


def decode(body: bytes, into: type[S]) -> S:
    """``body`` as ``into``, or 400 naming the field at fault."""
    try:
        value = msgspec.json.decode(body, type=into)
        loads(body)  # duplicate keys: after the typed decode, which refuses hostile bodies in C
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _UNKNOWN.search(text) or _MISSING.search(text) or _AT.search(text)
        param = found.group(1) if found else None
        raise InvalidInput(f"The request body is invalid: {text}.", param=param) from None
    except UnicodeDecodeError:  # msgspec before 0.23 lets it through to the key check
        raise InvalidInput("The request body is invalid: Invalid UTF-8.") from None
    except (msgspec.DecodeError, StrictJSONError, RecursionError) as exc:
        raise InvalidInput(f"The request body is invalid: {exc}.") from None
    return value
