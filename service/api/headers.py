"""Request and response headers shared by the controllers (and their OpenAPI text)."""

from __future__ import annotations

import re
from typing import Annotated, TypeVar

from litestar import Response
from litestar.datastructures import ResponseHeader
from litestar.params import HeaderParameter

from service.core.model import Precondition

T = TypeVar("T")

IdempotencyKey = Annotated[
    str | None,
    HeaderParameter(
        name="Idempotency-Key",
        required=False,
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="A client-chosen key (1-255 visible ASCII characters), on every call that "
        "writes. A retry with the same key and request returns the original committed result "
        "without writing again or calling the model, on any replica; the same key with another "
        "request is 422 idempotency_key_reused; while the first request runs, 409 "
        "request_in_progress. Requests that fail do not use the key up.",
    ),
]
IfMatch = Annotated[
    str | None,
    HeaderParameter(
        name="If-Match",
        required=False,
        description='Strong ETag of the revision the client last saw, e.g. `"3"`; on mismatch '
        "the request fails with 412 precondition_failed before anything else happens.",
    ),
]

ETAG = ResponseHeader(
    name="ETag",
    description='The conversation\'s revision as a strong ETag, e.g. `"3"`.',
    documentation_only=True,
)
CORRELATION_ID = ResponseHeader(
    name="X-Correlation-Id",
    description="Echoes a client-sent X-Correlation-Id of 1-128 safe characters, else a new id; "
    "the same value as an error body's correlation_id.",
    documentation_only=True,
)
CONVERSATION_ID = ResponseHeader(
    name="X-Conversation-Id",
    description="The conversation of this stream. For a new conversation the id is provisional: "
    "it exists only if the turn commits (message.done with a non-null revision).",
    documentation_only=True,
)
TURN_ID = ResponseHeader(
    name="X-Turn-Id",
    description="The turn's id: its status, events (resumable on any replica with "
    "Last-Event-ID) and cancellation are at /api/v1/turns/{turn_id}.",
    documentation_only=True,
)
LastEventId = Annotated[
    str,
    HeaderParameter(
        name="Last-Event-ID",
        required=False,
        pattern=r"^[0-9]{0,10}$",  # empty: absent
        description="The id of the last event received: the stream resumes after it.",
    ),
]
RETRY_AFTER = ResponseHeader(
    name="Retry-After",
    description="On 429 rate_limited, when the provider sent one.",
    documentation_only=True,
)


def with_etag(body: T, revision: int) -> Response[T]:
    """``body`` with its conversation's revision as a strong ETag, as If-Match quotes it back."""
    return Response(body, headers={"ETag": f'"{revision}"'})


_REVISION_TAG = re.compile(r'"([0-9]{1,18})"')  # ASCII digits only; revisions fit 63 bits


def parse_if_match(value: str | None) -> Precondition:
    """``*`` or absent: no precondition. Otherwise the strong ETags listed; anything that is
    not a strong revision tag (weak tags, other digits, garbage) matches nothing."""
    if value is None or value.strip() == "*":
        return None
    tags = (_REVISION_TAG.fullmatch(tag.strip()) for tag in value.split(","))
    return frozenset(int(tag[1]) for tag in tags if tag)
