"""Token accounting on the relay's per-token path, through the daemon: a node that writes compact
vLLM/OpenAI JSON (each token counted from its bytes, without a parse) — one event a write, and
several in one write — still has its usage counted, or, when it sends none, its content chunks;
its first token still times TTFT; the usage chunk the gateway asked for is still cut out, and
every other byte reaches the client as the node wrote it."""

from __future__ import annotations

import asyncio

import orjson
from conftest import auth, base_config, wait_until
from metrics_text import metric
from upstream_peer import Peer

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def event(delta: dict[str, object], **extra: object) -> bytes:
    ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
          "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], **extra}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def stream(usage: bool) -> list[bytes]:
    """The node's writes: a role-only first chunk, 12 tokens (3 of them in one write), the finish
    chunk, the usage chunk when asked for (OpenAI's ``"usage": null`` on every token then)."""
    extra = {"usage": None} if usage else {}
    tokens = [event({"content": f"t{i} "}, **extra) for i in range(12)]
    writes = [event({"role": "assistant", "content": ""}, **extra), *tokens[:8], b"".join(tokens[8:11]), tokens[11],
              event({}, **extra)]
    if usage:
        writes.append(b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":30,"completion_tokens":12,'
                      b'"total_tokens":42}}\n\n')
    return [*writes, b"data: [DONE]\n\n"]


async def relay(serve, gateway, http, usage: bool) -> tuple[object, bytes]:
    """The stream through the gateway, in lockstep: the node writes its next piece once the client
    has what the gateway passed on of the last (so each write is one read of the gateway's)."""
    writes = stream(usage)
    go: asyncio.Queue[None] = asyncio.Queue()

    async def node(peer: Peer) -> None:
        req = await peer.read_request()
        assert req is not None and b'"include_usage":true' in req.body
        await peer.send(HEAD)
        for data in writes:
            await peer.send(b"%x\r\n%s\r\n" % (len(data), data))
            await go.get()
        await peer.send(b"0\r\n\r\n")

    srv = await serve(node)
    gw = await gateway(base_config({"o": srv.url}, kind="openai", path="/v1"))
    got = b""
    async with http.post(gw.url + "/v1/chat/completions", json=BODY, headers=auth()) as r:
        assert r.status == 200
        for data in writes:
            if b'"choices":[]' not in data:  # the usage chunk: the client did not ask for it
                got += await asyncio.wait_for(r.content.readexactly(len(data)), 10)
            go.put_nowait(None)
        got += await r.read()
    return gw, got


async def test_a_node_that_sends_no_usage_has_its_content_chunks_counted(serve, gateway, http) -> None:
    gw, got = await relay(serve, gateway, http, usage=False)
    assert got == b"".join(stream(False))

    async def counted() -> bool:
        return await metric(http, gw, "kiloline_tokens_total", route="gen", key="alice") == 12

    await wait_until(counted)
    assert await metric(http, gw, "kiloline_ttft_seconds_count", route="gen") == 1


async def test_usage_is_counted_and_cut_out_while_tokens_pass_unparsed(serve, gateway, http) -> None:
    gw, got = await relay(serve, gateway, http, usage=True)
    assert got == b"".join(w for w in stream(True) if b'"choices":[]' not in w)

    async def counted() -> bool:
        return await metric(http, gw, "kiloline_tokens_total", route="gen", key="alice") == 42

    await wait_until(counted)
    assert await metric(http, gw, "kiloline_ttft_seconds_count", route="gen") == 1
