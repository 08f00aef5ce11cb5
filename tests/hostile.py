"""Small tools for attacking the gateway on loopback: a raw-socket client that sends exactly the
bytes it is given, and a misbehaving node that answers with exactly the bytes it is told to."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    status_line: str = ""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self) -> dict:
        return orjson.loads(self.body)


class RawClient:
    """One TCP connection; writes raw bytes, reads one HTTP/1.x answer (Content-Length or close)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout: float = 5) -> Answer:
        async with asyncio.timeout(timeout):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = [(k, v) for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)]
            n = next((int(v) for k, v in headers if k.lower() == "content-length"), None)
            body = await self.reader.readexactly(n) if n is not None else await self.reader.read()
        return Answer(int(lines[0].split(" ")[1]), headers, body, lines[0])

    async def closed(self, timeout: float = 5) -> bytes:
        """Everything the server sent until it closed the connection (raises on timeout)."""
        data = b""
        async with asyncio.timeout(timeout):
            with contextlib.suppress(ConnectionError):
                while chunk := await self.reader.read(65536):
                    data += chunk
        return data

    async def silent_for(self, seconds: float) -> bool:
        """True when nothing at all (not even the close) arrives within ``seconds``."""
        try:
            async with asyncio.timeout(seconds):
                await self.reader.read(1)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.writer.close()


async def exchange(port: int, data: bytes, timeout: float = 5) -> Answer:
    c = await RawClient.connect(port)
    try:
        await c.send(data)
        return await c.answer(timeout)
    finally:
        c.close()


Behaviour = Callable[["NodeConn"], Awaitable[None]]


@dataclass
class NodeConn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    seen: list[str]

    async def read_head(self) -> str:
        head = await self.reader.readuntil(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        self.seen.append(line)
        return line

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


@dataclass
class HostileNode:
    """A node whose every connection runs ``behaviour``; records the request lines it got."""

    behaviour: Behaviour
    seen: list[str] = field(default_factory=list)
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> HostileNode:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        conn = NodeConn(reader, writer, self.seen)
        try:
            await self.behaviour(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def echo_path(conn: NodeConn) -> None:
    """A well-behaved node: answers every request with the request line it received."""
    while True:
        line = await conn.read_head()
        body = line.encode("latin-1")
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body))


async def endless_headers(conn: NodeConn) -> None:
    """A hostile node: a status line, then header lines for as long as anyone reads them."""
    await conn.read_head()
    await conn.send(b"HTTP/1.1 200 OK\r\n")
    n = 0
    while True:
        await conn.send(b"".join(b"X-Flood-%d: %s\r\n" % (n + i, b"z" * 60) for i in range(200)))
        n += 200
