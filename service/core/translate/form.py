"""What every provider's own form has to say about its items (``Form``), and what the forms
share: the ids turnstore gives what a provider sent without one, a call's arguments read, a
data URL taken apart.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from service.core.errors import InvalidInput


@dataclass(frozen=True)
class FunctionCall:
    """A function call as every surface reads it."""

    call_id: str
    name: str
    arguments: str  # the model's JSON text, unparsed: the tool gate judges it


@dataclass(frozen=True)
class Shown:
    """One Responses item that a form's item is shown as on the OpenAI surface."""

    item: dict[str, Any]  # the Responses item it reads as (no ``id``, never sealed content)
    id: str  # the id a client that keeps its own history is shown (OpenAI's shape: relayed)
    own: str | None  # the id it is known by in its turn (None: by its place, as a message)
    call_id: str | None = None
    # It stands for the whole item: a reference to it restores the item itself, and where
    # the item is opaque, it (when reasoning) carries the item sealed as encrypted_content.
    whole: bool = False


class Form(Protocol):
    """One provider's own items, kept as the provider sent them (a block, a part, a message).

    A form is told by its items' first bytes (``owns``: cheap, as a window may hold hundreds of
    KiB of items, then exact). Everything else about its items is asked of it here, so that
    items.py, the window, the relay, restore and the views never name a provider. Everything
    the seam (translate/__init__.py) says of an item follows from these four answers.
    """

    name: str
    # What its items can begin with, "{" then any whitespace left out of the item's bytes:
    # an item that begins otherwise is none of its (told without asking ``owns``).
    starts: tuple[bytes, ...]

    def owns(self, item: msgspec.Raw) -> bool:
        """This form's item (else: a Responses item, or another form's)."""
        ...

    def opaque(self, item: msgspec.Raw) -> bool:
        """It holds what only its issuer can read (thinking, a signature): its exact bytes go
        back only to the origin that made it (another gets what it reads as, its reasoning
        left out)."""
        ...

    def shown(self, item: msgspec.Raw) -> list[Shown]:
        """The Responses items it is shown as, in order: one for a block or a part, several
        for a message that holds thinking, text and calls at once (Chat's). Its thinking, if
        any, as ``reasoning``: what another provider never gets."""
        ...

    def calls(self, item: msgspec.Raw) -> list[FunctionCall]:
        """The function calls it makes (the model's arguments text as it sent it)."""
        ...


# -- the Responses items every form's request translation reads, by their heads ----------------


class ItemHead(msgspec.Struct):
    type: str | None = None
    role: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = ""


class CallItem(msgspec.Struct):
    call_id: str
    name: str
    arguments: str = "{}"


class Output(msgspec.Struct):
    call_id: str
    output: str | list[dict[str, Any]] = ""


def read_item(item: msgspec.Raw, model: str) -> Message | CallItem | Output | None:
    """A Responses item as a translator sends it on: a message, a function call or a call's
    output; None for a reasoning or compaction item (another provider's: readable by its issuer
    alone); 400 for any other, naming the ``model`` it cannot be sent to ("a Gemini model")."""
    head = msgspec.json.decode(item, type=ItemHead)
    if head.type in (None, "message") and head.role is not None:
        return msgspec.json.decode(item, type=Message)
    if head.type == "function_call":
        return msgspec.json.decode(item, type=CallItem)
    if head.type == "function_call_output":
        return msgspec.json.decode(item, type=Output)
    if head.type in ("reasoning", "compaction"):
        return None
    raise unsendable("An item", head.type, model)


def said(part: dict[str, Any]) -> Any:
    """A content part's words: a text part's text, a refusal's refusal (falsy: none); None for
    a part of another type."""
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return part.get("text") or ""
    if kind == "refusal":
        return part.get("refusal") or ""
    return None


def content_parts(
    parts: list[dict[str, Any]],
    model: str,
    words: Callable[[Any], dict[str, Any]],
    other: Callable[[dict[str, Any]], dict[str, Any] | None],
) -> list[dict[str, Any]]:
    """Responses content parts as a provider's: text and refusals by ``words`` (none where they
    say nothing), any other part by ``other``; 400 for a part ``other`` makes nothing of (None),
    naming the ``model`` it cannot be sent to."""
    out: list[dict[str, Any]] = []
    for part in parts:
        text = said(part)
        if text is None:
            translated = other(part)
            if translated is None:
                raise unsendable("A content part", part.get("type"), model)
            out.append(translated)
        elif text:
            out.append(words(text))
    return out


def unsendable(what: str, kind: str | None, model: str) -> InvalidInput:
    """400: an item or a content part (``what``) of a type ``model`` has no place for."""
    return InvalidInput(f"{what} of type {kind!r} cannot be sent to {model}.", param="input")


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


def text_of(content: str | list[dict[str, Any]] | None) -> str:
    """A message's or an output's text: itself, or its parts' texts (a refusal's too)."""
    if isinstance(content, str):
        return content
    return "".join(
        str(p.get("text") or p.get("refusal") or "") for p in content or () if isinstance(p, dict)
    )
