"""Small helpers shared by the API tests."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

CHAT = "/api/v1/chat"


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The contract's envelope, with the same correlation id in body and header."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and isinstance(error["message"], str)
    assert error["correlation_id"] == response.headers["x-correlation-id"]
    assert "Traceback" not in response.text and "SELECT" not in response.text
    return dict(error)


async def snapshot(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    """Everything stored, to compare before and after a failed turn."""
    async with engine.connect() as conn:
        conversations = (await conn.execute(text("SELECT * FROM conversations ORDER BY id"))).all()
        turns = (
            await conn.execute(
                text(
                    "SELECT conversation_id, seq, user_message, assistant_message, "
                    "replay_items::text FROM turns ORDER BY conversation_id, seq"
                )
            )
        ).all()
    return [tuple(r) for r in conversations] + [tuple(r) for r in turns]


@asynccontextmanager
async def serve(app: Any, **config: Any) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a loopback port, in this test's event loop (so a
    test can pause a fake provider with an asyncio.Event), over real HTTP with real
    disconnects. ``config`` overrides uvicorn options."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    options: dict[str, Any] = {
        "lifespan": "on", "log_level": "warning", "timeout_graceful_shutdown": 5, **config,
    }  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
