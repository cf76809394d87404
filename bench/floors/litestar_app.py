"""The Litestar floor: the least Litestar app that answers turnstore's turn endpoints with the
turn's statements (bench/floors/turn.py): one handler per route taking the body as a msgspec
struct, no dependencies, no middleware. What turnstore's framework costs at least.

Served as ``uvicorn --factory bench.floors.litestar_app:create`` with DATABASE_URL set."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.response import ServerSentEvent, ServerSentEventMessage

from bench.database import libpq_url
from bench.floors.turn import (
    ChatRequest,
    ChatResponse,
    Floor,
    Refused,
    ResponseCreate,
    response_object,
)


def create() -> Litestar:
    floors: list[Floor] = []

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        floors.append(await Floor.open(libpq_url(os.environ["DATABASE_URL"])))
        try:
            yield
        finally:
            await floors.pop().close()

    @post("/api/v1/chat", status_code=200)
    async def chat(data: ChatRequest) -> Response[ChatResponse]:
        cid = uuid.uuid4().hex
        done = await floors[0].turn(data.message, data.conversation_id)
        answer = ChatResponse(
            str(done.conversation_id), done.reply.text, "completed", None, done.revision, cid
        )
        return Response(answer, headers={"ETag": f'"{done.revision}"', "X-Correlation-Id": cid})

    @post("/api/v1/chat/stream", status_code=200, media_type="text/event-stream")
    async def stream(data: ChatRequest) -> ServerSentEvent:
        cid = uuid.uuid4().hex
        turn = await floors[0].start_stream(data.message, data.conversation_id)

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            async for seq, name, event in turn.events():
                yield ServerSentEventMessage(id=str(seq), event=name, data=event.decode())

        headers = {
            "X-Correlation-Id": cid,
            "X-Conversation-Id": str(turn.conversation_id),
            "X-Turn-Id": str(turn.run_id),
        }
        return ServerSentEvent(events(), headers=headers)

    @post("/v1/responses", status_code=200)
    async def respond(data: ResponseCreate) -> Response[dict[str, Any]]:
        cid = uuid.uuid4().hex
        done = await floors[0].turn(data.input, data.conversation)
        headers = {"X-Correlation-Id": cid, "X-Request-Id": cid}
        return Response(response_object(done), headers=headers)

    @post("/v1/conversations", status_code=200)
    async def conversation() -> dict[str, Any]:
        made = await floors[0].create_conversation()
        return {"id": f"conv_{made.hex}", "object": "conversation", "metadata": {}}

    @get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    def refused(_: Request[Any, Any, Any], exc: Refused) -> Response[bytes]:
        cid = uuid.uuid4().hex
        return Response(exc.body(cid), status_code=exc.status, media_type=MediaType.JSON)

    return Litestar(
        route_handlers=[chat, stream, respond, conversation, readyz],
        exception_handlers={Refused: refused},
        lifespan=[lifespan],
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
