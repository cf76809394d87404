"""The listing cursor: the (created_at, id) of a page's last conversation, opaque to clients."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from uuid import UUID

from service.core.errors import InvalidInput
from service.core.model import Summary

# Before every conversation: the first page starts here.
FIRST_PAGE = (datetime.max.replace(tzinfo=UTC), UUID(int=(1 << 128) - 1))


def encode_cursor(last: Summary) -> str:
    raw = f"{last.created_at.isoformat()}|{last.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> tuple[datetime, UUID]:
    """The position a cursor names; InvalidInput for anything this API did not make (a
    crafted time that is not a representable UTC instant included)."""
    if cursor is None:
        return FIRST_PAGE
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, ident = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError("no time zone")
        return when.astimezone(UTC), UUID(ident)
    except (ValueError, OverflowError):
        raise InvalidInput("after is not a cursor this API returned.", param="after") from None
