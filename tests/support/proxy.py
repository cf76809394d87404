"""A TCP proxy in front of PostgreSQL that a test can cut: a real network failure between an
app and its database (connections reset, new ones refused), without stopping a server that
other tests share.

    async with TcpProxy(host, port) as proxy:   # proxy.url(database_url): through it
        proxy.cut()      # every open connection reset, every new one closed at once
        proxy.restore()  # connections pass again
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

from sqlalchemy.engine import make_url


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.cut_off = False
        self.port = 0

    @classmethod
    def to(cls, database_url: str) -> TcpProxy:
        """A proxy to the server of ``database_url`` (TCP; the local server by default)."""
        url = make_url(database_url)
        return cls(url.host or "127.0.0.1", url.port or 5432)

    def url(self, database_url: str) -> str:
        """``database_url`` through this proxy."""
        proxied = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return proxied.render_as_string(hide_password=False)

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        self._reset_all()
        await self._server.wait_closed()

    def cut(self) -> None:
        """The database is unreachable from now on: open connections reset, new ones closed."""
        self.cut_off = True
        self._reset_all()

    def restore(self) -> None:
        self.cut_off = False

    def _reset_all(self) -> None:
        for writer in list(self._open):
            _reset(writer)
        self._open.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            _reset(writer)
            return
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                self._open.discard(end)
                _reset(end)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError):
        writer.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close at once, without waiting for what is unsent (as a lost network would)."""
    transport = writer.transport
    if not transport.is_closing():
        transport.abort()
