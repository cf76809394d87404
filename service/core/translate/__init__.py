"""Each provider's own item form, and the one seam through which the rest of turnstore reads them.

A conversation's replay items are kept in the form of the provider that made them: the
Responses API's items, Anthropic's content blocks (anthropic.py), Gemini's parts (gemini.py).
Everything outside this package asks about an item through the functions below, which find
its form by its first bytes (``form_of``) and ask the form (base.Form); none of them names a
provider, and none decodes an item whole to tell its form.

Adding a provider's form is one entry: a module here with its ``Form`` (how its items read as
Responses items, which are calls, which are opaque, what another provider gets of them) and its
request translation, and its form in ``FORMS``. Nothing else changes.

- ``for_form``: a request's items for a provider of one form: its own items as they are,
  every other form's as the Responses items they read as (``neutral``: their thinking and
  signatures left out). The Responses API takes ``to_items``, the same with no form its own.
- ``neutral``: what another origin gets of an item (the window's rule for turns another
  provider, endpoint or model made, and the one retry without opaque items).
- ``readable`` / ``shown_item`` / ``listed``: an item as the OpenAI surface shows it.
- ``relayed`` / ``opened`` / ``twin``: what a client that keeps its own history is shown of an
  item (its opaque bytes sealed), and reading it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from service.core.translate.anthropic import ANTHROPIC
from service.core.translate.base import Call, Form, provider_id
from service.core.translate.gemini import GEMINI

__all__ = [
    "FORMS",
    "Call",
    "Form",
    "call",
    "for_form",
    "form_of",
    "is_opaque",
    "listed",
    "neutral",
    "opened",
    "provider_id",
    "readable",
    "relayed",
    "shown_item",
    "to_items",
    "twin",
]

FORMS: tuple[Form, ...] = (ANTHROPIC, GEMINI)


class _Head(msgspec.Struct):
    type: str | None = None
    encrypted_content: str | None = None


def form_of(item: msgspec.Raw) -> Form | None:
    """The provider form ``item`` is kept in (None: a Responses item)."""
    for form in FORMS:
        if form.owns(item):
            return form
    return None


def is_opaque(item: msgspec.Raw) -> bool:
    """An item only the provider, endpoint and model that made it can read, or that holds
    something only they can (a signature): sealed reasoning, a compaction item, a form's
    opaque items."""
    form = form_of(item)
    if form is not None:
        return form.opaque(item)
    head = msgspec.json.decode(item, type=_Head)
    return head.type == "compaction" or (head.type == "reasoning" and bool(head.encrypted_content))


def neutral(item: msgspec.Raw) -> msgspec.Raw | None:
    """What another origin gets of ``item``: a form's item as the Responses item it reads as,
    without what only its issuer reads; a Responses item as it is, unless opaque (None: left
    out)."""
    form = form_of(item)
    if form is not None:
        return form.neutral(item)
    return None if is_opaque(item) else item


def for_form(items: list[msgspec.Raw], own: Form | None) -> list[msgspec.Raw]:
    """``items`` with every form's items but ``own``'s made Responses items (``items`` itself
    when they hold none, as most requests)."""
    forms = [form_of(item) for item in items]
    if all(form is None or form is own for form in forms):
        return items
    out: list[msgspec.Raw] = []
    for item, form in zip(items, forms, strict=True):
        kept = item if form is None or form is own else form.neutral(item)
        if kept is not None:
            out.append(kept)
    return out


def to_items(items: list[msgspec.Raw]) -> list[msgspec.Raw]:
    """``items`` as the Responses API takes them."""
    return for_form(items, None)


def call(item: msgspec.Raw) -> Call | None:
    """The function call a form's item is (None: not one, or a Responses item)."""
    form = form_of(item)
    return form.call(item) if form is not None else None


def listed(item: msgspec.Raw) -> tuple[str | None, str | None, str] | None:
    """A form's item's own id, call id and shown type (None: a Responses item, read as is)."""
    form = form_of(item)
    return form.listed(item) if form is not None else None


def readable(item: msgspec.Raw) -> Any:
    """An item as the Responses API reads it (a form's as the item it reads as)."""
    form = form_of(item)
    return form.as_item(item) if form is not None else msgspec.json.decode(item)


def shown_item(item: msgspec.Raw) -> dict[str, Any]:
    """An output item as a client is shown it before its turn ends: a form's item as the
    Responses item it reads as, under the id it is listed by (others as they are)."""
    form = form_of(item)
    if form is None:
        return msgspec.json.decode(item)  # type: ignore[no-any-return]
    own, _, _ = form.listed(item)
    return {**form.as_item(item), "id": own}


def relayed(item: msgspec.Raw, seal: Callable[[str], str]) -> list[dict[str, Any]]:
    """A form's item as a client that keeps its own history is shown it, under ids made from
    its bytes (the same wherever it is shown): the Responses item it reads as, and, where it
    holds what only its issuer reads, the item itself sealed (``seal``) as ``encrypted_content``:
    of that item when it reads as reasoning, else of a reasoning item right after it (a
    signature on a call or a text), which ``opened`` and ``twin`` turn back into the item."""
    form = form_of(item)
    assert form is not None
    sealed = seal(bytes(item).decode()) if form.opaque(item) else None
    shown = form.as_item(item, sealed)
    shown["id"] = provider_id(shown["type"], item)
    if sealed is None or shown["type"] == "reasoning":
        return [shown]
    carrier = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
    return [shown, {**carrier, "id": provider_id("reasoning", item)}]


def opened(content: str) -> msgspec.Raw | None:
    """The form's item an opened ``encrypted_content`` holds (``relayed`` sealed it whole), or
    None: another provider's encrypted content."""
    if not content.startswith("{"):
        return None
    raw = msgspec.Raw(content.encode())
    return raw if form_of(raw) is not None else None


def twin(sent: Any, item: msgspec.Raw) -> bool:
    """Whether ``sent`` (an item a client sent back, decoded) is what ``relayed`` showed of
    ``item`` besides the reasoning item that carried it: the same call, or the same text."""
    form = form_of(item)
    if form is None or not isinstance(sent, dict):
        return False
    shown = form.as_item(item)
    if shown["type"] == "reasoning" or sent.get("type", "message") != shown["type"]:
        return False
    if shown["type"] == "function_call":
        return bool(sent.get("call_id") == shown["call_id"])
    if shown["type"] == "message" and sent.get("role") == "assistant":
        content = sent.get("content")
        text = content if isinstance(content, str) else _texts(content)
        return text == _texts(shown["content"])
    return False


def _texts(parts: Any) -> str:
    if not isinstance(parts, list):
        return ""
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
