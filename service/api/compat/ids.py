"""The ids of the OpenAI-compatible surface, all derived from turnstore's own.

A conversation is ``conv_<uuid hex>`` (``/api/v1`` shows the same uuid with dashes; both are
accepted everywhere). A response is a committed turn: ``resp_<conversation hex><revision>``,
so its lookup needs no index of its own and stays within its conversation (one shard's). An
item stored without an id (the user's input items) is shown as ``msg_<conversation hex>
<revision><index>``; its stored bytes are never changed.
"""

from __future__ import annotations

import re
import uuid

from service.core.errors import ConversationNotFound, ResponseNotFound
from service.usecases.relay import view_id as view_item_id

__all__ = ["conversation_id", "parse_conversation", "parse_response", "response_id", "view_item_id"]

_CONVERSATION = re.compile(r"(?:conv_)?([0-9a-f]{32})")
_RESPONSE = re.compile(r"resp_([0-9a-f]{32})([0-9a-f]{8})")


def conversation_id(cid: uuid.UUID) -> str:
    return f"conv_{cid.hex}"


def parse_conversation(raw: str) -> uuid.UUID:
    """``conv_<hex>``, bare hex or a dashed uuid; anything else looks like an unknown id."""
    match = _CONVERSATION.fullmatch(raw.replace("-", "") if "-" in raw else raw)
    if match is None:
        raise ConversationNotFound()
    return uuid.UUID(match.group(1))


def response_id(cid: uuid.UUID, revision: int) -> str:
    return f"resp_{cid.hex}{revision:08x}"


def parse_response(raw: str) -> tuple[uuid.UUID, int]:
    match = _RESPONSE.fullmatch(raw)
    if match is None or int(match.group(2), 16) < 1:
        raise ResponseNotFound()
    return uuid.UUID(match.group(1)), int(match.group(2), 16)
