"""An OpenAI token stream through the daemon's relay (the sync stream sink, pieces written from the
node connection's callback): byte for byte and in order, the usage chunk the gateway asked for cut
out, and a client that does not read holds the node back instead of the gateway's memory."""

from __future__ import annotations

import asyncio

import orjson
from conftest import auth, base_config
from upstream_peer import Peer

N, SIZE = 300, 64 * 1024


def event(i: int) -> bytes:
    ev = {"choices": [{"index": 0, "delta": {"content": f"{i:05d}" + "x" * SIZE}}]}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":300,"total_tokens":303}}\n\n'


async def test_a_slow_client_gets_the_whole_stream_and_holds_the_node_back(serve, gateway, http) -> None:
    sent = [0]

    async def node(peer: Peer) -> None:
        req = await peer.read_request()
        assert req is not None and b'"include_usage":true' in req.body
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(N):
            data = event(i)
            await peer.send(b"%x\r\n%s\r\n" % (len(data), data))  # waits while the gateway does not read
            sent[0] += 1
        for data in (USAGE, b"data: [DONE]\n\n"):
            await peer.send(b"%x\r\n%s\r\n" % (len(data), data))
        await peer.send(b"0\r\n\r\n")

    srv = await serve(node)
    gw = await gateway(base_config({"o": srv.url}, kind="openai", path="/v1", request_timeout_sec=120))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        await r.content.readexactly(len(event(0)))  # the stream is under way
        await asyncio.sleep(1.0)  # then the client reads nothing for a while
        held_at = sent[0]
        rest = await r.read()
    assert held_at < N, "the node was never held back: everything was buffered somewhere"
    assert event(0) + rest == b"".join(event(i) for i in range(N)) + b"data: [DONE]\n\n"
