"""Every id either surface shows, derived from turnstore's own, and how each is read back.

- A conversation is a uuid: ``/api/v1`` shows it dashed, ``/v1`` as ``conv_<hex>``; both
  forms are accepted everywhere. A malformed id looks exactly like an unknown one.
- A response is a turn: ``resp_<conversation hex><revision, 8 hex>``, the revision it makes, so
  its lookup needs no index of its own and stays within its conversation (one shard's). A
  background response is named before its turn holds the conversation, so by its run:
  ``resp_<conversation hex><run hex>``. A ``store: false`` response's id names nothing.
- An item stored without an id (a user's input item) is shown as
  ``msg_<conversation hex><revision, 8 hex><index, 4 hex>``: the id names where the item is.
  An item the provider named is shown as ``<its prefix>_<conversation hex><digest of its id,
  16 hex>``: a client that names it back (``item_reference``, a replayed item) names its
  conversation, so any replica finds the stored copy without an index of item ids. The
  stored bytes, the provider's own id included, never change.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass

from service.core.errors import ConversationNotFound, ResponseNotFound

MAX_REVISION = 2**31 - 1  # revisions are PostgreSQL integers
_RESPONSE = re.compile(r"resp_([0-9a-f]{32})([0-9a-f]{8}|[0-9a-f]{32})")
_VIEW_ITEM = re.compile(r"[a-z]{1,16}_([0-9a-f]{32})(?:[0-9a-f]{12}|[0-9a-f]{16})")
_PREFIX = re.compile(r"([a-z]{1,16})_")


def conversation_id(cid: uuid.UUID) -> str:
    """The /v1 form."""
    return f"conv_{cid.hex}"


def parse_conversation_id(raw: str) -> uuid.UUID:
    """A uuid in any of its usual forms, or the ``conv_<hex>`` the OpenAI surface shows."""
    try:
        return uuid.UUID(raw.removeprefix("conv_"))
    except ValueError:
        raise ConversationNotFound() from None  # malformed looks exactly like unknown


def response_id(cid: uuid.UUID, revision: int) -> str:
    return f"resp_{cid.hex}{revision:08x}"


def run_response_id(cid: uuid.UUID, run_id: uuid.UUID) -> str:
    return f"resp_{cid.hex}{run_id.hex}"


def unstored_response_id() -> str:
    """The id of a ``store: false`` response: it names nothing, anywhere."""
    return f"resp_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseRef:
    """What a response id names: a conversation and the revision its turn makes, or (a
    background response) the run that makes it."""

    conversation_id: uuid.UUID
    revision: int | None = None
    run_id: uuid.UUID | None = None


def parse_response_id(raw: str) -> ResponseRef:
    """What ``raw`` names (ResponseNotFound if it names nothing)."""
    match = _RESPONSE.fullmatch(raw)
    if match is None:
        raise ResponseNotFound()
    cid, rest = uuid.UUID(match.group(1)), match.group(2)
    if len(rest) == 32:
        return ResponseRef(cid, run_id=uuid.UUID(rest))
    if not 1 <= int(rest, 16) <= MAX_REVISION:
        raise ResponseNotFound()  # a revision PostgreSQL's integer cannot hold names nothing
    return ResponseRef(cid, revision=int(rest, 16))


def view_item_id(cid: uuid.UUID, revision: int, index: int) -> str:
    """The id shown for an item stored without one: it names where the item is."""
    return f"msg_{cid.hex}{revision:08x}{index:04x}"


def shown_item_id(cid: uuid.UUID, provider_id: str) -> str:
    """The id shown for an item the provider named ``provider_id`` in conversation ``cid``."""
    prefix = _PREFIX.match(provider_id)
    digest = hashlib.blake2b(provider_id.encode(), digest_size=8).hexdigest()
    return f"{prefix.group(1) if prefix else 'item'}_{cid.hex}{digest}"


def view_item_conversation(item_id: str) -> uuid.UUID | None:
    """The conversation a shown item id names (None: not such an id)."""
    match = _VIEW_ITEM.fullmatch(item_id)
    return uuid.UUID(match.group(1)) if match else None
