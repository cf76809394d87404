"""A kept /v1 response shown (service/usecases/kept_responses.py): as a Response as it is
now, its input items, or its events again from any replica."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from litestar import Request
from litestar.response import ServerSentEvent

from service.api.compat import item_views as views
from service.api.compat.answers import source_of
from service.api.compat.objects import response_error, response_object
from service.api.compat.stream import Output, ResponseStream
from service.api.correlation import correlation_id
from service.api.deps import Api
from service.api.sse import EventStream, closed_with_response, released_with_response, sse_events
from service.core.asks import Echo
from service.core.items import input_count
from service.usecases.kept_responses import Found


def shown(found: Found, api: Api, *, encrypted: bool = False) -> dict[str, Any]:
    """The Response of a response as it is now: its committed turn's, or its run's status."""
    turn, run = found.turn, found.run
    echo = echo_of(found, api)
    if turn is not None and found.revision is not None:
        output = Output.of_turn(turn).shown(
            api.ids, found.conversation_id, found.revision, encrypted
        )
        return response_object(
            found.conversation_id,
            echo,
            rid=found.id,
            status=turn.status,
            output=output,
            incomplete_reason=turn.incomplete_reason,
            usage=turn.usage,
            completed_at=turn.created_at,
        )
    assert run is not None  # a response not committed is one that runs, or ran, as a run
    body = response_object(found.conversation_id, echo, rid=found.id, status=run.status)
    if run.error_code is not None:
        body["error"] = response_error(run.error_code, run.error_message or "")
    return body


def echo_of(found: Found, api: Api) -> Echo:
    """What a response echoes, and when it was created (an /api/v1 turn's, which keeps no
    record: when its turn committed, or its run started)."""
    turn, run = found.turn, found.run
    model = turn.origin.model if turn is not None and turn.origin else api.cases.responses.model
    echo = Echo.of_record(found.response, model)
    created_at = echo.created_at
    if created_at is None:
        made = turn.created_at if turn is not None else run.created_at if run else None
        created_at = made.timestamp() if made is not None else None
    return replace(echo, stored=echo.stored or found.stored, created_at=created_at)


def input_items(found: Found, api: Api, encrypted: bool) -> list[dict[str, Any]]:
    """The items a response was asked with, as shown (none before its turn commits)."""
    if found.turn is None or found.revision is None:
        return []
    turn = found.turn
    inputs = turn.replay_items[: input_count(turn.replay_items)]
    own = {call.call_id for call in turn.tool_calls}
    return views.output_items(
        api.ids,
        found.conversation_id,
        found.revision,
        inputs,
        0,
        encrypted=encrypted,
        own_calls=own,
    )


async def resumed(
    request: Request[Any, Any, Any], response_id: str, starting_after: int | None, api: Api
) -> ServerSentEvent:
    """A streamed response's events again, from the start (or after ``starting_after``),
    then live to its end: the same events with the same numbers on any replica."""
    found, events = await api.cases.kept.replay(api.owner, response_id)
    assert found.run is not None
    released_with_response(request.scope, api.cases.runs.reader(api.owner))  # or a JSON 429
    echo = echo_of(found, api)
    run = api.cases.runs.live(found.run.id, api.owner)
    source = source_of(api, found.conversation_id, run, found.run.id)
    rendering = ResponseStream(
        found.id,
        found.conversation_id,
        echo,
        ids=api.ids,
        source=source,
        starting_after=starting_after,
    )
    cid = correlation_id(request.scope)
    stream = sse_events(
        events, rendering, api.cases.sse_keepalive_s, correlation_id=cid, follower=True
    )
    closed_with_response(request.scope, stream)
    return EventStream(stream)
