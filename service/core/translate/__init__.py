"""Each provider's own item form, and the one seam through which the rest of turnstore reads them.

A conversation's replay items are kept in the form of the provider that made them: the
Responses API's items, Anthropic's content blocks (anthropic_blocks.py), Gemini's parts
(gemini_parts.py), Chat Completions' assistant messages (chat_messages.py). Everything outside
this package asks about an item through the functions below, which find its form by its first
bytes (``form_of``) and ask the form (form.py's ``Form``); none of them names a provider,
and none decodes an item whole to tell its form.

How to add a provider's item form: a module here with its ``Form`` (``owns``: its items told
by their first bytes; ``opaque``: which go back only to their issuer; ``shown``: the Responses
items each is shown as, one or several, each with its ids; ``calls``: the function calls it
makes) and its request translation (its own items verbatim, Responses items translated), and
its form in ``FORMS``. Nothing else changes: every rule below is written once, from those
four answers.

- ``neutral``: what another origin gets of an item (the window's rule for turns another
  provider, endpoint or model made, and the one retry without opaque items): a form's item as
  the Responses items it is shown as, its reasoning (thinking, signatures) left out.
- ``for_form``: a request's items for a provider of one form: its own items as they are,
  every other form's ``neutral``. The Responses API takes ``to_items``, the same with no form
  its own.
- ``shown`` / ``readable`` / ``shown_items`` / ``calls``: an item as the OpenAI surface shows
  and reads it.
- ``relayed`` / ``opened`` / ``twin``: what a client that keeps its own history is shown of an
  item (an opaque item sealed whole, carried as a reasoning item's ``encrypted_content``), and
  reading it back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from service.core.translate.anthropic_blocks import ANTHROPIC
from service.core.translate.chat_messages import CHAT
from service.core.translate.form import Form, FunctionCall, Shown, provider_id, text_of
from service.core.translate.gemini_parts import GEMINI

__all__ = [
    "FORMS",
    "Form",
    "FunctionCall",
    "Shown",
    "calls",
    "for_form",
    "form_of",
    "is_opaque",
    "neutral",
    "opened",
    "provider_id",
    "readable",
    "relayed",
    "shown",
    "shown_items",
    "to_items",
    "twin",
]

FORMS: tuple[Form, ...] = (ANTHROPIC, GEMINI, CHAT)


class _Head(msgspec.Struct):
    type: str | None = None
    encrypted_content: str | None = None


# What a form's item can begin with: an item that begins otherwise (most, as most are
# Responses items) is told by one look at its first bytes, not one per form (a window of
# hundreds of items is read for every request).
_STARTS = tuple(start for form in FORMS for start in form.starts)


def form_of(item: msgspec.Raw) -> Form | None:
    """The provider form ``item`` is kept in (None: a Responses item)."""
    head = memoryview(item)[:48].tobytes()
    if not (head[:1] + head[1:].lstrip()).startswith(_STARTS):
        return None
    for form in FORMS:
        if form.owns(item):
            return form
    return None


def readable_item(item: msgspec.Raw) -> bool:
    """Whether a form's item is one its form reads (shown, its calls); a Responses item is.
    An item from outside (an import) is asked before it is kept: a turn over one that is not
    would fail on every request."""
    form = form_of(item)
    if form is None:
        return True
    try:
        form.shown(item)
        form.calls(item)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, KeyError, TypeError):
        return False
    return True


def is_opaque(item: msgspec.Raw) -> bool:
    """An item only the provider, endpoint and model that made it can read, or that holds
    something only they can (thinking, a signature): sealed reasoning, a compaction item, a
    form's opaque items."""
    form = form_of(item)
    if form is not None:
        return form.opaque(item)
    head = msgspec.json.decode(item, type=_Head)
    return head.type == "compaction" or (head.type == "reasoning" and bool(head.encrypted_content))


def shown(item: msgspec.Raw) -> list[Shown] | None:
    """The Responses items a form's item is shown as (None: a Responses item, shown as is)."""
    form = form_of(item)
    return form.shown(item) if form is not None else None


def calls(item: msgspec.Raw) -> list[FunctionCall] | None:
    """The function calls a form's item makes (None: a Responses item, read by its head)."""
    form = form_of(item)
    return form.calls(item) if form is not None else None


def neutral(item: msgspec.Raw) -> list[msgspec.Raw]:
    """What another origin gets of ``item``: a form's item as the Responses items it is shown
    as, without its reasoning (readable by its issuer alone) or an empty text; a Responses
    item as it is, unless opaque (nothing)."""
    parts = shown(item)
    if parts is None:
        return [] if is_opaque(item) else [item]
    return [
        msgspec.Raw(msgspec.json.encode(part.item))
        for part in parts
        if part.item["type"] != "reasoning"
        and (part.item["type"] != "message" or text_of(part.item["content"]))
    ]


def for_form(items: list[msgspec.Raw], own: Form | None, plain: int = 0) -> list[msgspec.Raw]:
    """``items`` with every form's items but ``own``'s made Responses items (``items`` itself
    when they hold none, as most requests). Its first ``plain`` items are known to be
    Responses items (a window's, ``ProviderRequest.plain``): they are not looked at."""
    plain = min(plain, len(items))
    forms: list[Form | None] = [None] * plain
    forms += [form_of(item) for item in items[plain:]]
    if all(form is None or form is own for form in forms[plain:]):
        return items
    out: list[msgspec.Raw] = []
    for item, form in zip(items, forms, strict=True):
        out += [item] if form is None or form is own else neutral(item)
    return out


def to_items(items: list[msgspec.Raw], plain: int = 0) -> list[msgspec.Raw]:
    """``items`` as the Responses API takes them (``plain``: see ``for_form``)."""
    return for_form(items, None, plain)


def readable(item: msgspec.Raw) -> list[dict[str, Any]]:
    """An item as the Responses API reads it: a form's as the items it is shown as."""
    parts = shown(item)
    return [msgspec.json.decode(item)] if parts is None else [part.item for part in parts]


def shown_items(item: msgspec.Raw) -> list[dict[str, Any]]:
    """An output item as a client is shown it before its turn ends: a form's item as the
    Responses items it is shown as, each under the id it is listed by (others as they are)."""
    parts = shown(item)
    if parts is None:
        return [msgspec.json.decode(item)]
    return [{**part.item, "id": part.own} for part in parts]


def relayed(item: msgspec.Raw, seal: Callable[[str], str]) -> list[dict[str, Any]]:
    """A form's item as a client that keeps its own history is shown it, each part under the
    id a client is shown (``Shown.id``: the same wherever it is shown); an opaque item also
    sealed whole (``seal``) as ``encrypted_content``: of the part that stands for it when that
    part is reasoning, else of a reasoning item right after them (a signature on a call or a
    text), which ``opened`` and ``twin`` turn back into the item."""
    form = form_of(item)
    assert form is not None
    parts = form.shown(item)
    out = [{**part.item, "id": part.id} for part in parts]
    if not form.opaque(item):
        return out
    sealed = seal(bytes(item).decode())
    carrier = next(
        (out[n] for n, part in enumerate(parts) if part.whole and part.item["type"] == "reasoning"),
        None,
    )
    if carrier is not None:
        carrier["encrypted_content"] = sealed
        return out
    carried = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
    return [*out, {**carried, "id": provider_id("reasoning", item)}]


def opened(content: str) -> msgspec.Raw | None:
    """The form's item an opened ``encrypted_content`` holds (``relayed`` sealed it whole), or
    None: another provider's encrypted content."""
    if not content.startswith("{"):
        return None
    raw = msgspec.Raw(content.encode())
    return raw if form_of(raw) is not None else None


def twin(sent: Any, item: msgspec.Raw) -> bool:
    """Whether ``sent`` (an item a client sent back, decoded) is one of the items ``item`` was
    shown as besides its reasoning: the same call, or the same text (a client that keeps its
    own history sends them back beside the sealed item, which brings them back itself)."""
    parts = shown(item)
    if parts is None or not isinstance(sent, dict):
        return False
    kind = sent.get("type", "message")
    for part in parts:
        if kind != part.item["type"] or kind == "reasoning":
            continue
        if kind == "function_call" and sent.get("call_id") == part.item["call_id"]:
            return True
        if kind == "message" and sent.get("role") == "assistant":
            content = sent.get("content")
            said = text_of(content if isinstance(content, str | list) else None)
            if said == text_of(part.item["content"]):
                return True
    return False
