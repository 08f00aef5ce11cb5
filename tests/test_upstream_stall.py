"""The upstream client's stall watch (``UpstreamResponse.idle_sec``, a node's ``slow.stall_sec``):
a streamed answer silent for that long while the relay waits for it fails ``Stalled``; one that
keeps sending never does, however long it lasts; and the watch costs one loop timer per exchange,
not one per relayed piece (a token stream relays thousands of pieces a second).

Raw asyncio servers on loopback (tests/test_upstream.py's) write the exact bytes.
"""

from __future__ import annotations

import asyncio

import pytest
from test_upstream import Peer, pools, req, serve  # noqa: F401  (fixtures)

from kilolined.wire.upstream import Stalled

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def piece(i: int) -> bytes:
    data = b"data: {\"n\": %d}\n\n" % i
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_stream_that_never_goes_silent_that_long_is_not_stalled(serve, pools) -> None:  # noqa: F811
    """Longer in total than idle_sec, each gap well within it: every piece arrives, no stall."""
    n = 12

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)
        for i in range(n):
            await asyncio.sleep(0.1)
            await peer.send(piece(i))
        await peer.send(b"0\r\n\r\n")

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 0.6
    body = await resp.read()
    assert body == b"".join(b"data: {\"n\": %d}\n\n" % i for i in range(n))
    assert resp.complete
    resp.release()


async def test_silence_mid_stream_fails_stalled_and_the_socket_is_not_reused(serve, pools) -> None:  # noqa: F811
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD + piece(0) + piece(1))  # and then nothing, the socket open

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=30)
    resp.idle_sec = 0.2
    got = b""
    with pytest.raises(Stalled) as ei:
        while chunk := await resp.readany():
            got += chunk
    assert str(ei.value) == "stalled: no byte from the node for 0.2s"
    assert got == b"data: {\"n\": 0}\n\ndata: {\"n\": 1}\n\n"
    resp.release()
    assert pool.open_connections == 0 and not pool.idle


async def test_the_stall_clock_runs_only_while_the_relay_waits(serve, pools) -> None:  # noqa: F811
    """Pieces that waited in the buffer while the relay was busy (a slow client) are taken at
    once, however long ago the node sent them; the next wait gets its own idle_sec."""
    sent = asyncio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD + piece(0))
        sent.set()

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 0.2
    await sent.wait()
    await asyncio.sleep(0.5)  # the relay is elsewhere for longer than idle_sec
    assert await resp.readany() == b"data: {\"n\": 0}\n\n"
    with pytest.raises(Stalled):
        await resp.readany()
    resp.release()


async def test_silence_before_the_first_byte_fails_ready(serve, pools) -> None:  # noqa: F811
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)  # the head, then no body

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 0.2
    with pytest.raises(Stalled):
        await resp.ready()
    resp.release()


async def test_ready_returns_once_a_piece_is_there_and_leaves_it(serve, pools) -> None:  # noqa: F811
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)
        await asyncio.sleep(0.05)
        await peer.send(piece(7) + b"0\r\n\r\n")

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 5
    await resp.ready()
    assert await resp.read() == b"data: {\"n\": 7}\n\n"
    resp.release()


async def test_the_watch_arms_no_loop_timer_per_relayed_piece(serve, pools, monkeypatch) -> None:  # noqa: F811
    """Each piece is asked for before it exists (the server sends the next one only once the
    relay has taken the last), so every read waits; the loop's timers are counted meanwhile."""
    n = 40
    go: asyncio.Queue[int] = asyncio.Queue()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)
        for i in range(n):
            await go.get()
            await peer.send(piece(i))
        await go.get()
        await peer.send(b"0\r\n\r\n")

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 30
    loop = asyncio.get_running_loop()
    timers = [0]
    call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kw):  # type: ignore[no-untyped-def]
        timers[0] += 1
        return call_at(when, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    got = []
    go.put_nowait(0)
    while chunk := await resp.readany():
        got.append(chunk)
        go.put_nowait(0)
    monkeypatch.undo()
    assert b"".join(got) == b"".join(b"data: {\"n\": %d}\n\n" % i for i in range(n))
    assert len(got) == n  # one wait per piece, each one watched
    assert timers[0] <= 2, f"{timers[0]} loop timers armed for {n} pieces"
    resp.release()
