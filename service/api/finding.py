"""The query strings that find and account conversations: the listing's filters
(``metadata[KEY]=VALUE``, ``model``, ``created_after`` ..., ``q``) read into a Finding, and
GET /api/v1/usage. A parameter no route names, a date that is not RFC 3339 or a value out of
its bounds is 400 invalid_input naming it."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency, Provide
from litestar.openapi.spec import OpenAPIFormat
from litestar.params import QueryParameter, SkipValidation

from service.api.deps import Caller
from service.api.routes import Resource, route
from service.core.errors import InvalidInput, StorageError, Unauthorized
from service.core.search import Finding, words
from service.core.usage import UsageTotal

MAX_KEY_CHARS, MAX_VALUE_CHARS, MAX_PAIRS = 64, 512, 16  # as /v1 metadata
MAX_Q_CHARS = 1000
MAX_USAGE_DAYS = 366
DATES = ("created_after", "created_before", "updated_after", "updated_before")
LISTING = frozenset({"limit", "after", "model", "q", *DATES})
_METADATA = re.compile(r"metadata\[(.+)\]", re.DOTALL)
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})", re.ASCII
)

# Said as OpenAPI's date-time (RFC 3339) in the schema; checked here, naming the parameter.
Date = Annotated[
    str | None,
    QueryParameter(
        description="RFC 3339, e.g. 2026-01-31T00:00:00Z.", format=OpenAPIFormat.DATE_TIME
    ),
]


# What ``finding`` takes, as far as a schema can say it (no NUL, its length; that q holds a
# word, a letter or digit of any script, no pattern a schema checker reads says): in the
# schema only, so that what it refuses is refused by ``finding``, with its own message
# naming the parameter (Litestar's would quote the pattern).
Model = Annotated[
    str | None,
    QueryParameter(
        description="A model a turn used.",
        schema_extra={"minLength": 1, "maxLength": 256, "pattern": r"^[^\u0000]+$"},
    ),
]
Words = Annotated[
    str | None,
    QueryParameter(
        description="Words of the transcript (all of them, whole words, case-folded).",
        schema_extra={
            "minLength": 1,
            "maxLength": MAX_Q_CHARS,
            "pattern": r"^[^\u0000]*$",
        },
    ),
]


def rfc3339(name: str, value: str) -> datetime:
    """``value`` as an instant; InvalidInput naming ``name`` unless it is RFC 3339."""
    if not _RFC3339.fullmatch(value):
        raise InvalidInput(f"{name} must be an RFC 3339 date and time.", param=name)
    text = value.replace("z", "Z").replace("t", "T")
    if text[17:19] == "60":  # a leap second: as the second before it ends
        text = text[:17] + "59.999999" + text[19:].lstrip(".0123456789")
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:  # a day or an hour that no calendar has
        raise InvalidInput(f"{name} must be an RFC 3339 date and time.", param=name) from None
    try:
        return instant.astimezone(UTC)
    except OverflowError:  # before the year 1 or after 9999 in UTC: the ends of time
        end = datetime.min if instant.year == 1 else datetime.max
        return end.replace(tzinfo=UTC)


def _text(name: str, value: str, most: int) -> str:
    if "\x00" in value or not value or len(value) > most:
        raise InvalidInput(f"{name}: 1 to {most} characters, no NUL.", param=name)
    return value


def finding(request: Request[Any, Any, Any]) -> Finding | None:
    """The filters of a listing's query string (None: none)."""
    pairs: list[tuple[str, str]] = []
    found: dict[str, Any] = {}
    for name, value in request.query_params.multi_items():
        if matched := _METADATA.fullmatch(name):
            key = _text(name, matched.group(1), MAX_KEY_CHARS)
            pairs.append((key, _text(name, value, MAX_VALUE_CHARS)))
        elif name not in LISTING:
            raise InvalidInput(f"{name} is not a filter of this listing.", param=name)
        elif name in found:
            raise InvalidInput(f"{name} is given more than once.", param=name)
        elif name in DATES:
            found[name] = rfc3339(name, value)
        elif name == "q":
            if not words(_text(name, value, MAX_Q_CHARS)):
                raise InvalidInput("q has no word to search for.", param="q")
            found[name] = value
        elif name == "model":
            found[name] = _text(name, value, 256)
        else:
            found[name] = None  # limit, after: the route's own parameters
    if len(pairs) > MAX_PAIRS:
        raise InvalidInput(f"At most {MAX_PAIRS} metadata filters.", param="metadata")
    asked = {k: v for k, v in found.items() if v is not None}
    return Finding(metadata=tuple(pairs), **asked) if pairs or asked else None


def _listed(
    request: Request[Any, Any, Any],
    model: Model = None,
    q: Words = None,
    created_after: Date = None,
    created_before: Date = None,
    updated_after: Date = None,
    updated_before: Date = None,
) -> Finding | None:
    """The listing's filters as one value (its parameters named here, as the schema shows
    them; read by ``finding``, which names any it does not know)."""
    return finding(request)


FILTERS = Provide(_listed, sync_to_thread=False)
Filters = NamedDependency[SkipValidation[Finding | None]]


class UsageLine(msgspec.Struct):
    key: str
    turns: int
    input_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    output_tokens: int
    reasoning_tokens: int

    @classmethod
    def of(cls, total: UsageTotal) -> UsageLine:
        u = total.usage
        return cls(
            total.key,
            total.turns,
            u.input_tokens,
            u.cached_tokens,
            u.cache_write_tokens,
            u.output_tokens,
            u.reasoning_tokens,
        )


class UsageTotals(msgspec.Struct):
    """``data``: one line per key, ordered by key; ``total``: all of them (its key "total")."""

    data: list[UsageLine]
    total: UsageLine

    @classmethod
    def of(cls, totals: list[UsageTotal]) -> UsageTotals:
        lines = [UsageLine.of(t) for t in totals]
        fields = UsageLine.__struct_fields__[1:]
        sums = [sum(getattr(line, name) for line in lines) for name in fields]
        return cls(lines, UsageLine("total", *sums))


GroupBy = Annotated[
    Literal["day", "model", "conversation"],
    QueryParameter(description="What each line sums: a day (UTC), a model, a conversation."),
]


class UsageController(Resource):
    path = "/api/v1/usage"

    @get(
        "/",
        **route(
            "What the caller's committed turns cost, by day, model or conversation.",
            InvalidInput,
            Unauthorized,
            StorageError,
            description=f"Summed from each committed turn's stored usage, turns created from "
            f"`from` (default: 30 days before `to`) to `to` (default: now), at most "
            f"{MAX_USAGE_DAYS} days; turns that did not commit count nowhere.",
        ),
    )
    async def totals(
        self,
        request: Request[Any, Any, Any],
        api: Caller,
        group_by: GroupBy = "day",
        from_: Annotated[
            str | None,
            QueryParameter(name="from", description="RFC 3339.", format=OpenAPIFormat.DATE_TIME),
        ] = None,
        to: Date = None,
    ) -> UsageTotals:
        for name in request.query_params:
            if name not in ("from", "to", "group_by"):
                raise InvalidInput(f"{name} is not a parameter of usage.", param=name)
        until = rfc3339("to", to) if to is not None else datetime.now(UTC)
        # (by differences, which do not overflow near year 1 or 9999 as a sum would)
        default = until - min(timedelta(days=30), until - datetime.min.replace(tzinfo=UTC))
        since = rfc3339("from", from_) if from_ is not None else default
        if not (since <= until and until - since <= timedelta(days=MAX_USAGE_DAYS)):
            raise InvalidInput(
                f"from must be before to, at most {MAX_USAGE_DAYS} days.", param="from"
            )
        return UsageTotals.of(
            await api.cases.conversations.usage(api.owner, since, until, group_by)
        )
