"""Every id either surface shows, derived from turnstore's own, and how each is read back.

- A conversation is a uuid: ``/api/v1`` shows it dashed, ``/v1`` as ``conv_<hex>``; both
  forms are accepted everywhere. A malformed id looks exactly like an unknown one.
- A response is a committed turn: ``resp_<conversation hex><revision, 8 hex>``, so its lookup
  needs no index of its own and stays within its conversation (one shard's).
- An item stored without an id (a user's input item) is shown as
  ``msg_<conversation hex><revision, 8 hex><index, 4 hex>``: the id names where the item is;
  its stored bytes are never changed.
"""

from __future__ import annotations

import re
import uuid

from service.core.errors import ConversationNotFound, ResponseNotFound

MAX_REVISION = 2**31 - 1  # revisions are PostgreSQL integers
_RESPONSE = re.compile(r"resp_([0-9a-f]{32})([0-9a-f]{8})")
_VIEW_ITEM = re.compile(r"msg_([0-9a-f]{32})([0-9a-f]{8})([0-9a-f]{4})")


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


def parse_response_id(raw: str) -> tuple[uuid.UUID, int]:
    """The conversation and revision a response id names (ResponseNotFound if none)."""
    match = _RESPONSE.fullmatch(raw)
    if match is None or not 1 <= int(match.group(2), 16) <= MAX_REVISION:
        raise ResponseNotFound()  # a revision PostgreSQL's integer cannot hold names nothing
    return uuid.UUID(match.group(1)), int(match.group(2), 16)


def view_item_id(cid: uuid.UUID, revision: int, index: int) -> str:
    """The id shown for an item stored without one: it names where the item is."""
    return f"msg_{cid.hex}{revision:08x}{index:04x}"


def view_item_conversation(item_id: str) -> uuid.UUID | None:
    """The conversation a view-only item id names (None: not such an id)."""
    match = _VIEW_ITEM.fullmatch(item_id)
    return uuid.UUID(match.group(1)) if match else None
