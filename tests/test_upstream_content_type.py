"""UpstreamResponse.content_type: the answer's first Content-Type, as ``headers.get`` gives it,
read over a real socket from a node that answers a fixed head."""

from __future__ import annotations

import asyncio

import pytest

from kilolined.wire.upstream import NodePool


async def answer_with(head: bytes) -> tuple[asyncio.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head)
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\r\ncontent-TYPE: application/json; charset=utf-8\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-Content-Type: text/plain\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nContent-Type: text/html\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
])
async def test_content_type_is_what_headers_get_gives(head: bytes) -> None:
    srv, port = await answer_with(head)
    pool = NodePool(f"http://127.0.0.1:{port}")
    try:
        up = await pool.request("GET", "/", [], b"", 5.0)
        want = up.headers.get("Content-Type", "")
        assert up.content_type == want
        assert want in ("text/event-stream", "application/json; charset=utf-8", "")
        up.release()
    finally:
        pool.close()
        srv.close()
        await srv.wait_closed()
