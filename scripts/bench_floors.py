#!/usr/bin/env python3
"""The floors under the gateway: the least a Python server on this stack can spend per request.

Each is a server on 127.0.0.1:PORT that answers ``POST /gen/...`` the way the gateway's bench
route does, run (under callgrind) by ``bench_callgrind.py`` with the same client and counting:

- ``aiohttp-app``:    aiohttp ``web.Application`` answering itself (one route, body read, JSON 200);
- ``aiohttp-server``: aiohttp's low-level ``web.Server`` answering itself;
- ``aiohttp-proxy``:  a minimal ``web.Application`` handler that forwards the request to the node
  with the gateway's own upstream client (kilolined/wire/upstream.py) and returns its answer;
- ``uvloop-proxy``:   a bare uvloop ``asyncio.Protocol`` parsing with httptools, forwarding over one
  kept-alive node connection per client connection: no framework at all.

    python scripts/bench_floors.py KIND --port 8080 [--upstream http://127.0.0.1:9000]

Every one runs on uvloop, as the gateway does. They skip everything the gateway is for (auth,
limits, queue, leases, metrics, errors): they are floors, not alternatives.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections import deque
from urllib.parse import urlsplit

import httptools
import uvloop
from aiohttp import web

from kilolined.wire.upstream import NodePool

ANSWER = b'{"ok": true}'
KINDS = ("aiohttp-app", "aiohttp-server", "aiohttp-proxy", "uvloop-proxy")


# --------------------------------------------------------------------------- aiohttp answering itself


async def answer(request: web.BaseRequest) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


def app_itself() -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/gen/{tail:.*}", answer)
    return app


# --------------------------------------------------------------------------- aiohttp + our upstream client


def app_proxy(upstream: str) -> web.Application:
    pool = NodePool(upstream)

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        up = await pool.request(request.method, request.path_qs, [("Host", "node")], body, 600.0)
        try:
            data = await up.read()
        finally:
            up.release()
        return web.Response(body=data, status=up.status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/gen/{tail:.*}", forward)
    return app


# --------------------------------------------------------------------------- bare uvloop + httptools


class NodeSide(asyncio.Protocol):
    """One kept-alive connection to the node, one exchange at a time (HTTP/1.1 without pipelining)."""

    def __init__(self, client: ClientSide):
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        data = b"".join(self.body)
        self.body.clear()
        self.client.answer(self.parser.get_status_code(), data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.client.node_lost()


class ClientSide(asyncio.Protocol):
    def __init__(self, host: str, port: int):
        self.node_addr = (host, port)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.pending: deque[bytes] = deque()  # requests waiting for the node connection
        self.node: NodeSide | None = None
        self.connecting: asyncio.Task[object] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.node = NodeSide(self)
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(loop.create_connection(lambda: self.node, *self.node_addr))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body.clear()
        head = b"%s %s HTTP/1.1\r\nHost: node\r\nContent-Length: %d\r\n\r\n" % (
            self.parser.get_method(), self.url, len(body))
        msg = head + body
        node = self.node
        if node is not None and node.transport is not None:
            node.transport.write(msg)
        else:
            self.pending.append(msg)
            if node is not None:
                node.ready.add_done_callback(self._flush)

    def _flush(self, _: object) -> None:
        node = self.node
        while self.pending and node is not None and node.transport is not None:
            node.transport.write(self.pending.popleft())

    def answer(self, status: int, body: bytes) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (status, len(body), body))

    def node_lost(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        if self.node is not None and self.node.transport is not None:
            self.node.transport.close()


# --------------------------------------------------------------------------- running one


async def serve(kind: str, port: int, upstream: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if kind == "uvloop-proxy":
        u = urlsplit(upstream)
        server = await loop.create_server(lambda: ClientSide(u.hostname or "127.0.0.1", u.port or 80),
                                          "127.0.0.1", port)
        await stop.wait()
        server.close()
        return
    if kind == "aiohttp-server":
        runner: web.BaseRunner = web.ServerRunner(web.Server(answer), access_log=None)
    else:
        runner = web.AppRunner(app_itself() if kind == "aiohttp-app" else app_proxy(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await stop.wait()
    await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", default="http://127.0.0.1:80")
    args = ap.parse_args()
    uvloop.run(serve(args.kind, args.port, args.upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
