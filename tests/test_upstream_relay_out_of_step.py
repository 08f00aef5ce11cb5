"""``UpstreamResponse.relay`` hands each piece on from the parser's callback after one test (its
push is set only while it waits): a node out of step — a second answer nobody asked for in the
same write as the end of the first — never has its body handed to the client, and its socket is
never reused.

Raw asyncio servers on loopback (tests/test_upstream.py's) write the exact bytes.
"""

from __future__ import annotations

import asyncio

from relay_frames import HEAD, data, piece
from upstream_peer import Peer, req


async def test_a_second_answer_in_the_same_write_never_reaches_the_client(serve, pools) -> None:
    go: asyncio.Queue[int] = asyncio.Queue()
    extra = b"data: {\"not\": \"yours\"}\n\n"

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)
        await go.get()
        await peer.send(piece(0))
        await go.get()
        # the end of the first answer and a whole second one, in one write
        await peer.send(piece(1) + b"0\r\n\r\n" + HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(extra), extra))

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=30)
    got: list[bytes] = []

    def push(p: bytes) -> bool:
        got.append(p)
        go.put_nowait(0)
        return False

    async def drain() -> None:
        raise AssertionError("never full")

    go.put_nowait(0)
    await asyncio.wait_for(resp.relay(push, drain), 10)
    assert b"".join(got) == data(0) + data(1)
    resp.release()
    assert not pool.idle  # out of step: the socket is closed, not pooled
