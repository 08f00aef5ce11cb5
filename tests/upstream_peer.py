"""A raw TCP peer for the upstream tests, and the pools and requests that talk to it."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict

from kilolined.wire.upstream import NodePool, UpstreamResponse


@dataclass
class Request:
    line: str
    headers: list[tuple[str, str]]
    body: bytes

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def get(self, name: str) -> str | None:
        vals = self.get_all(name)
        assert len(vals) <= 1, f"{name} sent {len(vals)} times"
        return vals[0] if vals else None


class Peer:
    """One accepted connection, server side."""

    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.index = index
        self.reader = reader
        self.writer = writer
        self.requests: list[Request] = []
        self.got_request = asyncio.Event()
        self.client_closed = asyncio.Event()
        self.server_closed = False

    async def read_request(self) -> Request | None:
        """The next request, or None when the client closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = [(k, v) for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)]
            n = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
            body = await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_closed.set()
            return None
        req = Request(lines[0], headers, body)
        self.requests.append(req)
        self.got_request.set()
        return req

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.server_closed = True
        self.writer.close()

    async def until_client_closes(self) -> None:
        try:
            while await self.reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.client_closed.set()


Handler = Callable[[Peer], Awaitable[None]]


class RawServer:
    """``handler(peer)`` runs per connection; if it returns without closing, the socket stays open
    until the client closes it."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.peers: list[Peer] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.tls: ssl.SSLContext | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def accepted(self) -> int:
        return len(self.peers)

    @property
    def requests(self) -> list[Request]:
        return [r for p in self.peers for r in p.requests]

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(len(self.peers), reader, writer)
        self.peers.append(peer)
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        try:
            await self.handler(peer)
            if not peer.server_closed:
                await peer.until_client_closes()
        except (ConnectionError, asyncio.IncompleteReadError):
            peer.client_closed.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for p in self.peers:
            p.writer.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    made: list[RawServer] = []

    async def make(handler: Handler) -> RawServer:
        s = RawServer(handler)
        await s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        await s.stop()


@pytest.fixture
async def pools() -> AsyncIterator[Callable[[str], NodePool]]:
    made: list[NodePool] = []

    def make(url: str) -> NodePool:
        p = NodePool(url)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
    await asyncio.sleep(0)  # let the aborted transports report connection_lost


async def req(pool: NodePool, tail: str = "/", method: str = "GET", headers: dict[str, str] | None = None,
              body: bytes = b"", timeout: float = 2.0) -> UpstreamResponse:
    return await pool.request(method, tail, CIMultiDict(headers or {}), body, timeout)
