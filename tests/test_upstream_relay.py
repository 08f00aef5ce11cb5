"""The upstream client's streaming relay: its stall watch (``UpstreamResponse.idle_sec``, a node's
``slow.stall_sec``) — a streamed answer silent for that long while the relay waits for it fails
``Stalled``, one that keeps sending never does, however long it lasts, and the watch costs one
loop timer per exchange, not one per relayed piece — and ``relay()``, which hands each piece on
from the connection's callback: in order, with back-pressure, its push's errors and the node's
raised, and no future or task wake-up per piece (a token stream is thousands of pieces a second).

Raw asyncio servers on loopback (tests/test_upstream.py's) write the exact bytes.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from relay_frames import HEAD, data, piece
from upstream_peer import Peer, req

from kilolined.wire.upstream import Stalled, UpstreamResponse


async def test_a_stream_that_never_goes_silent_that_long_is_not_stalled(serve, pools) -> None:
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


async def test_silence_mid_stream_fails_stalled_and_the_socket_is_not_reused(serve, pools) -> None:
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


async def test_the_stall_clock_runs_only_while_the_relay_waits(serve, pools) -> None:
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


async def test_silence_before_the_first_byte_fails_ready(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)  # the head, then no body

    srv = await serve(handler)
    resp = await req(pools(srv.url), timeout=30)
    resp.idle_sec = 0.2
    with pytest.raises(Stalled):
        await resp.ready()
    resp.release()


async def test_ready_returns_once_a_piece_is_there_and_leaves_it(serve, pools) -> None:
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


async def test_the_watch_arms_no_loop_timer_per_relayed_piece(serve, pools, monkeypatch) -> None:
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


# --- relay() ------------------------------------------------------------------------------------------


def stepped(n: int, go: asyncio.Queue[int], end: bool = True):  # type: ignore[no-untyped-def]
    """A handler that sends piece i once the test puts to ``go`` (then the end, if ``end``)."""

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(HEAD)
        for i in range(n):
            await go.get()
            await peer.send(piece(i))
        if end:
            await go.get()
            await peer.send(b"0\r\n\r\n")

    return handler


async def test_relay_hands_on_every_piece_in_order_with_no_wait_per_piece(serve, pools, monkeypatch) -> None:
    n = 40
    go: asyncio.Queue[int] = asyncio.Queue()
    srv = await serve(stepped(n, go))
    pool = pools(srv.url)
    resp = await req(pool, timeout=30)
    resp.idle_sec = 30
    waits = [0]
    wait = UpstreamResponse._wait

    async def counting_wait(self: UpstreamResponse) -> None:
        waits[0] += 1  # each one a future, a task wake-up and the relay's coroutine resumed
        await wait(self)

    got: list[bytes] = []

    def push(piece_: bytes) -> bool:
        got.append(piece_)
        go.put_nowait(0)  # the next one, once this one is through
        return False

    async def drain() -> None:
        raise AssertionError("never full")

    monkeypatch.setattr(UpstreamResponse, "_wait", counting_wait)
    go.put_nowait(0)
    await resp.relay(push, drain)
    monkeypatch.undo()
    assert got == [data(i) for i in range(n)]
    assert waits[0] <= 2, f"{waits[0]} waits for {n} pieces"  # one wait for all of them (and the end)
    assert resp.complete
    resp.release()
    assert len(pool.idle) == 1  # a clean end: the socket goes back to the pool


async def test_relay_pauses_the_node_while_its_client_is_full(serve, pools) -> None:
    """push says full: the node socket is paused, pieces that arrive meanwhile wait, drain() is
    awaited, then they go on in order and the socket reads again."""
    n = 6
    go: asyncio.Queue[int] = asyncio.Queue()
    srv = await serve(stepped(n, go))
    resp = await req(pools(srv.url), timeout=30)
    got: list[bytes] = []
    drained = asyncio.Event()
    in_drain = asyncio.Event()

    def push(piece_: bytes) -> bool:
        got.append(piece_)
        return len(got) == 2  # full after the second

    async def drain() -> None:
        in_drain.set()
        await drained.wait()

    task = asyncio.create_task(resp.relay(push, drain))
    for _ in range(2):
        go.put_nowait(0)
    await asyncio.wait_for(in_drain.wait(), 10)
    assert resp._conn.paused
    for _ in range(n - 2 + 1):
        go.put_nowait(0)  # the rest and the end, sent while the client is full
    await asyncio.sleep(0.1)
    assert len(got) == 2  # held while full
    drained.set()
    await asyncio.wait_for(task, 10)
    assert b"".join(got) == b"".join(data(i) for i in range(n))
    assert not resp._conn.paused
    resp.release()


async def test_what_push_raises_ends_the_relay_and_the_socket(serve, pools) -> None:
    go: asyncio.Queue[int] = asyncio.Queue()
    srv = await serve(stepped(5, go))
    pool = pools(srv.url)
    resp = await req(pool, timeout=30)

    def push(piece_: bytes) -> bool:
        raise ConnectionResetError("client gone")

    async def drain() -> None:
        pass

    go.put_nowait(0)
    with pytest.raises(ConnectionResetError, match="client gone"):
        await asyncio.wait_for(resp.relay(push, drain), 10)
    resp.release()
    assert pool.open_connections == 0 and not pool.idle


@pytest.mark.parametrize("fault", ["stall", "deadline", "cut"])
async def test_the_node_failing_mid_relay_is_raised(serve, pools, fault: str) -> None:
    go: asyncio.Queue[int] = asyncio.Queue()
    srv = await serve(stepped(3, go, end=False))
    pool = pools(srv.url)
    resp = await req(pool, timeout=0.5 if fault == "deadline" else 30)
    resp.idle_sec = 0.2 if fault == "stall" else None
    got: list[bytes] = []

    def push(piece_: bytes) -> bool:
        got.append(piece_)
        if len(got) < 3:
            go.put_nowait(0)
        elif fault == "cut":
            srv.peers[0].close()
        return False

    async def drain() -> None:
        pass

    go.put_nowait(0)
    want = {"stall": Stalled, "deadline": TimeoutError, "cut": aiohttp.ClientPayloadError}[fault]
    with pytest.raises(want):
        await asyncio.wait_for(resp.relay(push, drain), 20)
    assert got == [data(i) for i in range(3)]
    resp.release()
    assert not pool.idle


async def test_pieces_that_came_before_the_relay_go_first(serve, pools) -> None:
    go: asyncio.Queue[int] = asyncio.Queue()
    srv = await serve(stepped(3, go))
    resp: UpstreamResponse = await req(pools(srv.url), timeout=30)
    go.put_nowait(0)
    await resp.ready()  # piece 0 waits in the buffer
    got: list[bytes] = []

    def push(piece_: bytes) -> bool:
        got.append(piece_)
        go.put_nowait(0)
        return False

    async def drain() -> None:
        pass

    await asyncio.wait_for(resp.relay(push, drain), 10)
    assert b"".join(got) == b"".join(data(i) for i in range(3))
    resp.release()
