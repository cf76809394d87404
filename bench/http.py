"""A minimal HTTP/1.1 client: the bench shares two cores with the server and PostgreSQL, so
its own cost per request must stay small (httpx costs several times more CPU)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Connection:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", *, close: bool = False
    ) -> tuple[int, bytes]:
        """Send one request (keep-alive unless ``close``); return status and whole body."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "")
            + "\r\n"
        )
        self._writer.write(head.encode() + body)
        status, payload = await _response(self._reader)
        if close:
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._reader = self._writer = None


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, b"".join(chunks)
            chunks.append(chunk[:-2])
    return status, await reader.read()


async def sse(
    port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[dict[str, str], dict[str, str]]]:
    """One Server-Sent Events request on its own connection: first (response headers, {}),
    then ({}, event fields) for each event as it arrives (comments skipped)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n".encode()
            + body
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        fields["status"] = head[0].split(" ", 2)[1]
        yield fields, {}
        buffer = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                return
            buffer += (await reader.readexactly(size + 2))[:-2].replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                event = dict(
                    line.split(": ", 1)
                    for line in block.decode().splitlines()
                    if ": " in line and not line.startswith(":")
                )
                if event:
                    yield {}, event
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
