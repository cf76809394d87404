"""The bare floor: a plain ASGI app (no framework) answering turnstore's turn endpoints with
the turn's statements (bench/floors/turn.py). What a server must spend per turn at least.

Served as ``uvicorn --factory bench.floors.bare:create`` with DATABASE_URL set."""

from __future__ import annotations

import os
import uuid
from typing import Any

import msgspec

from bench.database import libpq_url
from bench.floors.turn import (
    ChatRequest,
    ChatResponse,
    Floor,
    Refused,
    ResponseCreate,
    response_object,
    sse,
)

Scope = dict[str, Any]
_JSON = msgspec.json.Encoder()
_BAD_BODY = Refused(400, "invalid_input", "The request body is invalid.")


def _head(status: int, content_type: bytes, extra: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    headers = [(b"content-type", content_type), *extra]
    return {"type": "http.response.start", "status": status, "headers": headers}


async def _body(receive: Any) -> bytes:
    message = await receive()
    body: bytes = message.get("body", b"")
    while message.get("more_body"):
        message = await receive()
        body += message.get("body", b"")
    return body


def create() -> Any:
    floors: list[Floor] = []

    async def json(
        send: Any, status: int, body: bytes, cid: str, *extra: tuple[bytes, bytes]
    ) -> None:
        headers = [(b"content-length", b"%d" % len(body)), (b"x-correlation-id", cid.encode())]
        await send(_head(status, b"application/json", [*headers, *extra]))
        await send({"type": "http.response.body", "body": body})

    async def chat(floor: Floor, body: bytes, send: Any, cid: str) -> None:
        asked = msgspec.json.decode(body, type=ChatRequest)
        done = await floor.turn(asked.message, asked.conversation_id)
        answer = ChatResponse(
            str(done.conversation_id), done.reply.text, "completed", None, done.revision, cid
        )
        await json(send, 200, _JSON.encode(answer), cid, (b"etag", b'"%d"' % done.revision))

    async def stream(floor: Floor, body: bytes, send: Any, cid: str) -> None:
        asked = msgspec.json.decode(body, type=ChatRequest)
        turn = await floor.start_stream(asked.message, asked.conversation_id)
        await send(_head(200, b"text/event-stream; charset=utf-8", [
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
            (b"x-correlation-id", cid.encode()),
            (b"x-conversation-id", str(turn.conversation_id).encode()),
            (b"x-turn-id", str(turn.run_id).encode()),
        ]))  # fmt: skip
        async for seq, name, data in turn.events():
            event = sse(seq, name, data)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def respond(floor: Floor, body: bytes, send: Any, cid: str) -> None:
        asked = msgspec.json.decode(body, type=ResponseCreate)
        done = await floor.turn(asked.input, asked.conversation)
        await json(
            send, 200, _JSON.encode(response_object(done)), cid, (b"x-request-id", cid.encode())
        )

    async def conversation(floor: Floor, body: bytes, send: Any, cid: str) -> None:
        made = await floor.create_conversation()
        answer = {"id": f"conv_{made.hex}", "object": "conversation", "metadata": {}}
        await json(send, 200, _JSON.encode(answer), cid)

    routes = {
        "/api/v1/chat": chat,
        "/api/v1/chat/stream": stream,
        "/v1/responses": respond,
        "/v1/conversations": conversation,
    }

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        cid = uuid.uuid4().hex
        if scope["method"] == "GET" and scope["path"] == "/readyz":
            await json(send, 200, b'{"status":"ready"}', cid)
            return
        route = routes.get(scope["path"]) if scope["method"] == "POST" else None
        if route is None:
            await json(send, 404, Refused(404, "not_found", "No such route.").body(cid), cid)
            return
        try:
            await route(floors[0], await _body(receive), send, cid)
        except msgspec.DecodeError:  # ValidationError included
            await json(send, 400, _BAD_BODY.body(cid), cid)
        except Refused as refused:
            await json(send, refused.status, refused.body(cid), cid)

    async def lifespan(receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                floors.append(await Floor.open(libpq_url(os.environ["DATABASE_URL"])))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for floor in floors:
                    await floor.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    return app
