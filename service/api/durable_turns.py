"""Durable turns: a turn's status, its events (replayed, then followed live), cancelling it.

Any replica answers, whichever runs the turn; only its owner sees it (anyone else's turn id is
404 turn_not_found, like an unknown one).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Request, get, post
from litestar.params import FromPath, QueryParameter
from litestar.response import ServerSentEvent

from service.api.correlation import correlation_id
from service.api.deps import Caller
from service.api.headers import LastEventId
from service.api.routes import Resource, route
from service.api.schemas import TurnView
from service.api.sse import (
    EventStream,
    TurnEvents,
    closed_with_response,
    released_with_response,
    sse_events,
)
from service.core.errors import InvalidInput, StorageError, TurnNotFound, Unauthorized

MAX_SEQ = 2**31 - 1  # event numbers are PostgreSQL integers

After = Annotated[
    int | None,
    QueryParameter(gt=-1, le=MAX_SEQ, description="Events after this one (0: all of them)."),
]


def parse_turn_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise TurnNotFound() from None  # malformed looks exactly like unknown


def resume_after(last_event_id: str, after: int | None) -> int:
    if after is not None:
        return after
    if not last_event_id:
        return 0
    digits = last_event_id.isascii() and last_event_id.isdigit() and len(last_event_id) <= 10
    if not digits or int(last_event_id) > MAX_SEQ:  # a number SQL's integer holds, or 400
        raise InvalidInput("Last-Event-ID must be the id of an event of this turn.")
    return int(last_event_id)


class TurnController(Resource):
    path = "/api/v1/turns"

    @get(
        "/{turn_id:str}",
        **route(
            "A turn's status: queued, in_progress, completed, incomplete, failed, cancelled.",
            Unauthorized,
            TurnNotFound,
            StorageError,
        ),
    )
    async def status(self, turn_id: FromPath[str], api: Caller) -> TurnView:
        return TurnView.of(await api.cases.runs.status(parse_turn_id(turn_id), api.owner))

    @get(
        "/{turn_id:str}/events",
        media_type="text/event-stream",
        **route(
            "The turn's events after Last-Event-ID (or ?after=N), then live to its end.",
            InvalidInput,
            Unauthorized,
            TurnNotFound,
            StorageError,
            description="Server-Sent Events, each with its id; the same events as the turn's "
            "stream, ending with message.done or error. Readable for TURN_EVENTS_TTL_S after the "
            "turn ended.",
        ),
    )
    async def events(
        self,
        request: Request[Any, Any, Any],
        turn_id: FromPath[str],
        api: Caller,
        last_event_id: LastEventId = "",
        after: After = None,
    ) -> ServerSentEvent:
        tid, since = parse_turn_id(turn_id), resume_after(last_event_id, after)
        await api.cases.runs.status(
            tid, api.owner
        )  # an unknown turn is a JSON 404, before any stream
        released_with_response(request.scope, api.cases.runs.reader(api.owner))  # or a JSON 429
        source = api.cases.runs.events(tid, api.owner, since)
        cid = correlation_id(request.scope)
        events = sse_events(
            source, TurnEvents(cid), api.cases.sse_keepalive_s, correlation_id=cid, follower=True
        )
        closed_with_response(request.scope, events)
        return EventStream(events, headers={"X-Turn-Id": str(tid)})

    @post(
        "/{turn_id:str}/cancel",
        **route(
            "Stop the turn wherever it runs (nothing is kept; a commit that began ends).",
            Unauthorized,
            TurnNotFound,
            StorageError,
            status_code=200,
        ),
    )
    async def cancel(self, turn_id: FromPath[str], api: Caller) -> TurnView:
        return TurnView.of(await api.cases.runs.cancel(parse_turn_id(turn_id), api.owner))
