"""The query parameters of the /v1 item lists (a conversation's items, a response's input
items) and of reading one item: written once, so both lists read alike."""

from __future__ import annotations

from typing import Annotated

from litestar.params import QueryParameter

Include = Annotated[
    list[str] | None,
    QueryParameter(name="include[]", required=False, description="reasoning.encrypted_content"),
]
ItemLimit = Annotated[int, QueryParameter(ge=1, le=100, description="Items per page (1-100).")]
AfterItem = Annotated[str | None, QueryParameter(description="Items after this one (in order).")]
