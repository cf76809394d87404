"""What every provider's own form has to say about its items (``Form``), and what the forms
share: the ids turnstore gives what a provider sent without one, a call's arguments read, a
data URL taken apart.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from service.core.errors import InvalidInput


@dataclass(frozen=True)
class Call:
    """A function call as every surface reads it: its id, its name, its arguments' JSON text."""

    call_id: str
    name: str
    arguments: str


class Form(Protocol):
    """One provider's own items, kept as the provider sent them, one item a block or part.

    A form is told by its items' first bytes (``owns``: cheap, as a window may hold hundreds of
    KiB of items, then exact). Everything else about its items is asked of it here, so that
    items.py, the relay, restore and the views never name a provider.
    """

    name: str

    def owns(self, item: msgspec.Raw) -> bool:
        """This form's item (else: a Responses item, or another form's)."""
        ...

    def opaque(self, item: msgspec.Raw) -> bool:
        """It holds what only its issuer can read (thinking, a signature): it goes back only
        to the origin that made it."""
        ...

    def as_item(self, item: msgspec.Raw, sealed: str | None = None) -> dict[str, Any]:
        """The one Responses item it is listed as (no ``id``: the caller's to give). When it
        reads as ``reasoning``, ``sealed`` (the item itself, sealed by turnstore) is its
        ``encrypted_content``; never shown in clear."""
        ...

    def neutral(self, item: msgspec.Raw) -> msgspec.Raw | None:
        """What any other provider gets of it: the Responses item it reads as, without what only
        its issuer reads (None: nothing, e.g. thinking)."""
        ...

    def listed(self, item: msgspec.Raw) -> tuple[str | None, str | None, str]:
        """Its own id (None: known by its place), its call id (None: not a call), and the
        Responses type it is shown as."""
        ...

    def call(self, item: msgspec.Raw) -> Call | None:
        """The function call it is, if it is one."""
        ...


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "reasoning": "rs"}


def provider_id(kind: str, block: msgspec.Raw | None = None) -> str:
    """An id for an item a provider sent without one, shaped as OpenAI's (a prefix and 48 hex
    digits: a client that keeps its own history sends it back as a provider's, not as one
    naming something turnstore stored): a digest of ``block``, random without one."""
    token = hashlib.sha256(block).hexdigest()[:48] if block is not None else os.urandom(24).hex()
    return f"{_ID_PREFIXES[kind]}_{token}"


def arguments(text: str) -> Any:
    """A call's arguments (JSON text) as an object, as Anthropic's and Gemini's calls take
    them."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {"arguments": text}  # a model's malformed call, kept readable
    return value if isinstance(value, dict) else {"value": value}


def data_url(url: str) -> tuple[str, str] | None:
    """A ``data:`` URL's media type and base64 data (None: another URL); 400 when not base64."""
    if not url.startswith("data:"):
        return None
    meta, _, data = url[5:].partition(",")
    media_type, _, encoding = meta.partition(";")
    if encoding != "base64" or not data:
        raise InvalidInput("A data URL of an image or a file must be base64.", param="input")
    return media_type, data


def text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
