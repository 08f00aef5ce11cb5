"""kilolined.wire.upstream, the forwarding hot path's HTTP/1.1 client, against raw asyncio servers on
loopback that write exact bytes: keep-alive and its races, chunking, close-delimited bodies,
interim answers, malformed answers, timeouts, cancellation, back-pressure and idle pruning.

Each server counts the connections it accepted (``srv.accepted``) to prove reuse or non-reuse,
and records when the client closed a socket (``peer.client_closed``).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import os
import random
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from conftest import wait_until
from multidict import CIMultiDict
from upstream_peer import Handler, Peer, RawServer, req

from kilolined.wire import upstream
from kilolined.wire.deadlines import Deadlines
from kilolined.wire.upstream import ConnectFailed, NodePool

# --- a raw HTTP/1.1 server that says exactly what it is told ----------------------------------------


def answer(body: bytes = b"", status: str = "200 OK", headers: tuple[str, ...] = (),
           content_length: int | None = -1) -> bytes:
    """A whole response; ``content_length=None`` leaves the header out, -1 means ``len(body)``."""
    lines = [f"HTTP/1.1 {status}", *headers]
    if content_length is not None:
        lines.append(f"Content-Length: {len(body) if content_length == -1 else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def each_request(*answers: bytes) -> Handler:
    """Keep-alive: answer the n-th request on a connection with answers[n] (the last one repeats)."""

    async def handler(peer: Peer) -> None:
        i = 0
        while await peer.read_request() is not None:
            await peer.send(answers[min(i, len(answers) - 1)])
            i += 1

    return handler


async def fetch(pool: NodePool, tail: str = "/", **kw) -> tuple[int, bytes]:
    """One whole exchange: status and body, connection released."""
    resp = await req(pool, tail, **kw)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


async def closed_by_client(peer: Peer, timeout: float = 2.0) -> None:
    await asyncio.wait_for(peer.client_closed.wait(), timeout)


async def socket_dropped(srv: RawServer, pool: NodePool) -> None:
    """The pool closed its (only) socket to the server and keeps none open."""
    await closed_by_client(srv.peers[0])
    assert pool.open_connections == 0


# --- framing ---------------------------------------------------------------------------------------


async def test_content_length_response_fields_and_keep_alive_reuse(serve, pools) -> None:
    raw = (b"HTTP/1.1 200 Fine Thanks\r\nContent-Type: text/plain\r\nX-Multi: a\r\nx-multi: b\r\n"
           b"X-Name: caf\xc3\xa9\r\nContent-Length: 5\r\n\r\nhello")
    srv = await serve(each_request(raw))
    pool = pools(srv.url)

    resp = await req(pool, "/one")
    assert resp.status == 200
    assert resp.reason == "Fine Thanks"
    assert resp.content_length == 5
    assert resp.raw_headers[:3] == [("Content-Type", "text/plain"), ("X-Multi", "a"), ("x-multi", "b")]
    assert resp.raw_headers[3][1] == "café"
    assert resp.raw_headers[4] == ("Content-Length", "5")
    assert resp.headers["content-type"] == "text/plain"
    assert resp.headers["CONTENT-LENGTH"] == "5"
    assert resp.headers.getall("X-MULTI") == ["a", "b"]
    await wait_until(lambda: resp.complete, timeout=2, step=0.005)
    assert resp.body() == b"hello"
    assert resp.body() == b""  # taken out of the buffer
    resp.release()
    assert pool.open_connections == 1
    assert len(pool.idle) == 1

    status, body = await fetch(pool, "/two")
    assert (status, body) == (200, b"hello")
    assert srv.accepted == 1
    assert [r.line for r in srv.requests] == ["GET /one HTTP/1.1", "GET /two HTTP/1.1"]
    assert pool.open_connections == 1


async def test_chunked_response_streams_and_connection_is_reused(serve, pools) -> None:
    parts = [b"alpha-", b"beta-" * 50, b"gamma", b"\x00\xff" * 3000]

    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Seq: 1\r\n\r\n")
            for p in parts:
                await asyncio.sleep(0.01)
                await peer.send(b"%x\r\n%s\r\n" % (len(p), p))
            await asyncio.sleep(0.01)
            await peer.send(b"0\r\n\r\n")

    srv = await serve(handler)
    pool = pools(srv.url)

    resp = await req(pool)
    assert resp.status == 200
    assert resp.content_length is None
    assert resp.headers["Transfer-Encoding"] == "chunked"
    got = [c async for c in resp.content.iter_any()]
    assert b"".join(got) == b"".join(parts)
    assert len(got) >= 2  # delivered as it arrived, not buffered whole
    assert resp.complete
    resp.release()

    resp = await req(pool)
    assert await resp.read() == b"".join(parts)
    resp.release()

    resp = await req(pool)
    assert b"".join([c async for c in resp.iter_any()]) == b"".join(parts)
    resp.release()
    assert srv.accepted == 1
    assert len(srv.requests) == 3


async def test_close_delimited_body_is_read_to_eof_and_not_reused(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        if await peer.read_request() is None:
            return
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\nfirst part, ")
        await asyncio.sleep(0.02)
        await peer.send(b"second part")
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)

    resp = await req(pool)
    assert resp.status == 200
    assert resp.content_length is None
    assert not resp.complete
    assert await resp.read() == b"first part, second part"
    assert resp.complete
    resp.release()
    await wait_until(lambda: pool.open_connections == 0, timeout=2, step=0.005)

    status, body = await fetch(pool)
    assert (status, body) == (200, b"first part, second part")
    assert srv.accepted == 2


async def test_connection_close_header_prevents_reuse(serve, pools) -> None:
    srv = await serve(each_request(answer(b"bye", headers=("Connection: close",))))
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"bye")
    await closed_by_client(srv.peers[0])
    assert await fetch(pool) == (200, b"bye")
    assert srv.accepted == 2


async def test_http10_response_without_keep_alive_is_not_reused(serve, pools) -> None:
    srv = await serve(each_request(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")
    assert await fetch(pool) == (200, b"ok")
    assert srv.accepted == 2


async def test_head_ends_at_headers_and_connection_is_not_reused(serve, pools) -> None:
    srv = await serve(each_request(answer(content_length=100, headers=("Content-Type: image/png",))))
    pool = pools(srv.url)

    async with asyncio.timeout(2):
        resp = await req(pool, "/file", method="HEAD")
        assert resp.status == 200
        assert resp.content_length == 100
        assert resp.complete
        assert await resp.read() == b""
        assert [c async for c in resp.iter_any()] == []
        resp.release()
        await socket_dropped(srv, pool)

        resp = await req(pool, "/file", method="HEAD")
        assert resp.status == 200
        assert await resp.read() == b""
        resp.release()
    assert srv.accepted == 2
    assert srv.requests[0].line == "HEAD /file HTTP/1.1"
    assert srv.requests[0].get("Content-Length") is None


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n",
    b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nX-A: 1\r\n\r\n',
    b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nX-A: 1\r\nContent-Length: 10\r\n\r\n',  # describes, no body
], ids=["204", "304", "304-with-length"])
async def test_204_and_304_have_no_body_and_keep_the_connection(serve, pools, raw: bytes) -> None:
    srv = await serve(each_request(raw))
    pool = pools(srv.url)
    for _ in range(2):
        async with asyncio.timeout(2):
            resp = await req(pool)
            assert resp.status in (204, 304)
            assert resp.headers["X-A"] == "1"
            await wait_until(lambda r=resp: r.complete, timeout=1, step=0.005)
            assert resp.body() == b""
            assert await resp.read() == b""
            resp.release()
    assert srv.accepted == 1


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "two-writes"])
async def test_interim_1xx_answer_is_skipped(serve, pools, split: bool) -> None:
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nX-Interim: yes\r\n\r\n"
    final = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\ndone"

    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            if split:
                await peer.send(interim)
                await asyncio.sleep(0.02)
                await peer.send(final)
            else:
                await peer.send(interim + final)

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool)
    assert resp.status == 200
    assert resp.reason == "OK"
    assert resp.raw_headers == [("Content-Type", "text/plain"), ("Content-Length", "4")]
    assert "Link" not in resp.headers
    assert "X-Interim" not in resp.headers
    assert await resp.read() == b"done"
    resp.release()
    assert await fetch(pool) == (200, b"done")
    assert srv.accepted == 1


async def test_100_continue_then_answer(serve, pools) -> None:
    srv = await serve(each_request(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"x", status="201 Created")))
    pool = pools(srv.url)
    resp = await req(pool, method="POST", body=b"{}")
    assert (resp.status, resp.reason) == (201, "Created")
    assert await resp.read() == b"x"
    resp.release()


# --- keep-alive races and hang-ups -------------------------------------------------------------------


async def test_stale_keep_alive_after_server_close_uses_fresh_connection(serve, pools) -> None:
    """The node answers keep-alive, then closes the socket (no Connection: close)."""

    async def handler(peer: Peer) -> None:
        if await peer.read_request() is None:
            return
        await peer.send(answer(b"one"))
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"one")
    # Straight away: the client may or may not have seen the FIN yet; both must work.
    assert await fetch(pool) == (200, b"one")
    assert srv.accepted == 2
    # And once the FIN surely arrived.
    await wait_until(lambda: srv.peers[1].server_closed, timeout=2, step=0.005)
    await asyncio.sleep(0.05)
    assert await fetch(pool) == (200, b"one")
    assert srv.accepted == 3


async def test_stale_keep_alive_closed_when_next_request_arrives_is_retried(serve, pools) -> None:
    """The exact race: the reused socket dies with no response byte; the request is resent once on a
    fresh connection, transparently."""

    async def handler(peer: Peer) -> None:
        if await peer.read_request() is None:
            return
        await peer.send(answer(b"fresh"))
        if peer.index == 0:
            await peer.read_request()  # the node is already tearing this socket down
            peer.close()
            return
        while await peer.read_request() is not None:
            await peer.send(answer(b"fresh"))

    srv = await serve(handler)
    pool = pools(srv.url)
    assert await fetch(pool, "/a") == (200, b"fresh")
    assert srv.accepted == 1
    assert await fetch(pool, "/b") == (200, b"fresh")
    assert srv.accepted == 2
    assert [r.line for r in srv.peers[0].requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1"]
    assert [r.line for r in srv.peers[1].requests] == ["GET /b HTTP/1.1"]


async def test_reused_connection_with_a_partial_response_is_not_retried(serve, pools) -> None:
    """Bytes came back before the hang-up: the node saw the request, so no silent resend."""

    async def handler(peer: Peer) -> None:
        if await peer.read_request() is None:
            return
        await peer.send(answer(b"ok"))
        if await peer.read_request() is None:
            return
        await peer.send(b"HTTP/1.1 200 O")
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await req(pool)
    assert srv.accepted == 1


@pytest.mark.parametrize("when", ["at-accept", "after-request"])
async def test_fresh_connection_closed_before_response_raises_server_disconnected(serve, pools, when: str) -> None:
    async def handler(peer: Peer) -> None:
        if when == "after-request":
            await peer.read_request()
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)
    async with asyncio.timeout(2):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await req(pool)
    assert srv.accepted == 1  # a fresh socket is never retried
    await wait_until(lambda: pool.open_connections == 0, timeout=1, step=0.005)


async def test_connection_cut_mid_body_raises_payload_error(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(answer(b"0123456789", content_length=1000))
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool)
    assert resp.status == 200
    assert resp.content_length == 1000
    got = b""
    async with asyncio.timeout(2):
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in resp.iter_any():
                got += chunk
    assert got == b"0123456789"
    assert not resp.complete
    resp.release()
    assert pool.open_connections == 0

    resp = await req(pool)
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    resp.release()
    assert srv.accepted == 2


async def test_chunked_cut_mid_body_raises_payload_error(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        peer.close()

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool)
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    resp.release()


# --- timeouts and cancellation ---------------------------------------------------------------------


async def test_timeout_before_headers_closes_the_connection(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()  # and never answer

    srv = await serve(handler)
    pool = pools(srv.url)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await req(pool, timeout=0.2)
    assert 0.15 < loop.time() - t0 < 1.0
    assert pool.open_connections == 0
    await closed_by_client(srv.peers[0])
    assert srv.accepted == 1


async def test_timeout_mid_body_closes_the_connection(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(answer(b"0123456789", content_length=1000))  # and the rest never comes

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=0.3)
    assert resp.status == 200
    assert pool.open_connections == 1
    got = b""
    with pytest.raises(TimeoutError):
        async for chunk in resp.iter_any():
            got += chunk
    assert got == b"0123456789"
    assert not resp.complete
    await socket_dropped(srv, pool)
    resp.release()
    assert len(pool.idle) == 0


async def test_deadline_covers_the_whole_exchange_not_each_read(serve, pools) -> None:
    """A body trickling in (each piece well within the timeout) still ends at the deadline."""

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            await peer.send(b"1\r\nx\r\n")
            await asyncio.sleep(0.02)

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        await resp.read()
    assert loop.time() - t0 < 0.6
    resp.release()
    await closed_by_client(srv.peers[0])


async def test_cancel_while_waiting_for_headers_closes_the_connection(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()  # and never answer

    srv = await serve(handler)
    pool = pools(srv.url)
    task = asyncio.create_task(req(pool, timeout=5))
    await wait_until(lambda: srv.accepted == 1 and srv.peers[0].got_request.is_set(), timeout=2, step=0.005)
    assert pool.open_connections == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: pool.open_connections == 0, timeout=1, step=0.005)
    await closed_by_client(srv.peers[0])
    assert len(pool.idle) == 0


async def test_cancel_on_a_reused_connection_closes_it(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        if await peer.read_request() is None:
            return
        await peer.send(answer(b"first"))
        await peer.read_request()  # the second one is never answered

    srv = await serve(handler)
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"first")
    task = asyncio.create_task(req(pool, timeout=5))
    await wait_until(lambda: len(srv.peers[0].requests) == 2, timeout=2, step=0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await closed_by_client(srv.peers[0])
    await wait_until(lambda: pool.open_connections == 0, timeout=1, step=0.005)
    assert srv.accepted == 1


# --- errors -------------------------------------------------------------------------------------------


async def test_connect_refused_raises_connect_failed(pools) -> None:
    # Bound but not listening: nothing accepts on this port while the test runs.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        pool = pools(f"http://127.0.0.1:{port}")
        with pytest.raises(ConnectFailed) as ei:
            await req(pool)
    assert isinstance(ei.value, OSError)
    assert ei.value.errno == errno.ECONNREFUSED
    assert pool.open_connections == 0


@pytest.mark.parametrize("raw", [
    b"garbage\r\n\r\n",
    b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Header Line\r\n\r\n",
], ids=["garbage", "bad-status", "bad-header"])
async def test_malformed_response_head_raises_server_disconnected(serve, pools, raw: bytes) -> None:
    srv = await serve(each_request(raw))
    pool = pools(srv.url)
    async with asyncio.timeout(2):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await req(pool)
    assert srv.accepted == 1
    await socket_dropped(srv, pool)


async def test_malformed_chunk_mid_body_raises_payload_error(serve, pools) -> None:
    srv = await serve(each_request(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n"))
    pool = pools(srv.url)
    resp = await req(pool)
    assert resp.status == 200
    async with asyncio.timeout(2):
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    resp.release()
    await socket_dropped(srv, pool)


async def test_switching_protocols_is_an_error_not_a_relay(serve, pools) -> None:
    srv = await serve(each_request(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                   b"Connection: Upgrade\r\n\r\n\x81\x05hello"))
    pool = pools(srv.url)
    async with asyncio.timeout(2):
        with pytest.raises(aiohttp.ClientError):
            await req(pool)
    await socket_dropped(srv, pool)


async def test_extra_bytes_after_a_complete_body_mean_no_reuse(serve, pools) -> None:
    srv = await serve(each_request(answer(b"hello") + b"junk that nobody asked for"))
    pool = pools(srv.url)
    resp = await req(pool)
    assert await resp.read() == b"hello"
    assert resp.status == 200
    resp.release()
    assert await fetch(pool) == (200, b"hello")
    assert srv.accepted == 2


async def test_a_second_unrequested_response_does_not_alter_the_first(serve, pools) -> None:
    """A node out of step pipelines an answer nobody asked for behind the real one."""
    srv = await serve(each_request(answer(b"real", headers=("X-Which: real",))
                                   + answer(b"bogus", status="500 Oops", headers=("X-Which: bogus",))))
    pool = pools(srv.url)
    resp = await req(pool)
    assert await resp.read() == b"real"
    assert resp.status == 200
    assert resp.reason == "OK"
    assert resp.headers.getall("X-Which") == ["real"]
    resp.release()
    assert await fetch(pool) == (200, b"real")
    assert srv.accepted == 2  # the socket was out of step: never reused


async def test_unsolicited_bytes_on_an_idle_connection_drop_it(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(answer(b"ok"))
            await asyncio.sleep(0.02)
            await peer.send(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")

    srv = await serve(handler)
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")
    await socket_dropped(srv, pool)
    assert await fetch(pool) == (200, b"ok")
    assert srv.accepted == 2


async def test_header_with_line_break_raises_value_error_and_sends_nothing(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    for bad in ({"X-Bad": "a\r\nInjected: 1"}, {"X-Bad": "a\nInjected: 1"}, {"X-Bad": "a\rb"},
                {"X-Bad\r\nInjected": "1"}):
        with pytest.raises(ValueError):
            await req(pool, headers=bad)
    await asyncio.sleep(0.05)
    assert srv.accepted == 0  # rejected before any connection

    assert await fetch(pool) == (200, b"ok")
    with pytest.raises(ValueError):
        await req(pool, method="POST", headers={"X-Bad": "x\r\n\r\nGET /smuggled HTTP/1.1"}, body=b"{}")
    assert pool.open_connections == 1  # the idle socket was not touched
    assert await fetch(pool) == (200, b"ok")
    await asyncio.sleep(0.05)
    assert srv.accepted == 1
    assert [r.line for r in srv.requests] == ["GET / HTTP/1.1", "GET / HTTP/1.1"]


# --- what the node receives ----------------------------------------------------------------------------


async def test_request_line_base_path_content_length_and_headers(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url + "/base")

    assert await fetch(pool, "/x?q=1", method="POST", body=b'{"a":1}',
                       headers={"Host": "node.example", "Content-Type": "application/json",
                                "X-Request-Id": "r-1"}) == (200, b"ok")
    r = srv.requests[-1]
    assert r.line == "POST /base/x?q=1 HTTP/1.1"
    assert r.get("Host") == "node.example"
    assert r.get("Content-Type") == "application/json"
    assert r.get("X-Request-Id") == "r-1"
    assert r.get("Content-Length") == "7"
    assert r.get("Authorization") is None
    assert r.body == b'{"a":1}'

    assert await fetch(pool, "/empty", method="POST") == (200, b"ok")
    r = srv.requests[-1]
    assert r.line == "POST /base/empty HTTP/1.1"
    assert r.get("Content-Length") == "0"
    assert r.body == b""

    assert await fetch(pool, "/get?a=b&c=d", headers={"Accept": "*/*"}) == (200, b"ok")
    r = srv.requests[-1]
    assert r.line == "GET /base/get?a=b&c=d HTTP/1.1"
    assert r.get("Content-Length") is None
    assert r.get("Accept") == "*/*"

    assert await fetch(pool, "/gone", method="DELETE") == (200, b"ok")
    assert srv.requests[-1].get("Content-Length") is None  # a body-less DELETE has none (RFC 9110 §8.6)

    assert await fetch(pool, "/g", method="GET", body=b"abc") == (200, b"ok")
    assert srv.requests[-1].get("Content-Length") == "3"
    assert srv.requests[-1].body == b"abc"

    assert srv.accepted == 1  # all on one keep-alive socket


async def test_repeated_headers_are_all_sent(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    h: CIMultiDict[str] = CIMultiDict([("X-Tag", "a"), ("x-tag", "b")])
    resp = await pool.request("GET", "/", h, b"", 2.0)
    await resp.read()
    resp.release()
    assert srv.requests[0].get_all("X-Tag") == ["a", "b"]


@pytest.mark.parametrize("base", ["", "/", "/base/"])
async def test_base_path_variants(serve, pools, base: str) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url + base)
    await fetch(pool, "/x")
    assert srv.requests[0].line == ("GET /base/x HTTP/1.1" if base == "/base/" else "GET /x HTTP/1.1")


async def test_basic_auth_from_the_url(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(f"http://user:s3cret@127.0.0.1:{srv.port}/v1")
    await fetch(pool, "/models")
    r = srv.requests[0]
    assert r.line == "GET /v1/models HTTP/1.1"
    assert r.get("Authorization") == "Basic " + base64.b64encode(b"user:s3cret").decode()

    await fetch(pool, "/models", headers={"authorization": "Bearer node-token"})
    assert srv.requests[1].get_all("Authorization") == ["Bearer node-token"]  # the caller's wins, once


async def test_large_post_body_arrives_intact(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    big = random.Random(7).randbytes(300_000)
    assert await fetch(pool, "/up", method="PUT", body=big, headers={"Content-Type": "image/png"}) == (200, b"ok")
    assert srv.requests[0].get("Content-Length") == str(len(big))
    assert srv.requests[0].body == big


# --- back-pressure -----------------------------------------------------------------------------------


async def test_back_pressure_bounds_the_buffer_and_the_body_arrives_intact(serve, pools) -> None:
    big = os.urandom(8 << 20)
    limit = upstream.HIGH_WATER + (512 << 10)

    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            peer.writer.write(answer(content_length=len(big)) + big)
            await peer.writer.drain()

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=10)
    h = hashlib.sha256()
    n = 0
    most = 0
    paused_seen = False
    for i in range(100_000):
        chunk = await resp._next()
        if not chunk:
            break
        h.update(chunk)
        n += len(chunk)
        most = max(most, resp._buffered)
        assert resp._buffered <= limit
        if i < 30:
            await asyncio.sleep(0.01)  # a slow client: the node's bytes pile up ...
            most = max(most, resp._buffered)
            paused_seen = paused_seen or resp._conn.paused
            assert resp._buffered <= limit  # ... but only up to the high-water mark
    assert n == len(big)
    assert h.hexdigest() == hashlib.sha256(big).hexdigest()
    assert most > upstream.LOW_WATER  # the slow phase did fill the buffer
    assert paused_seen
    assert resp.complete
    resp.release()
    assert pool.open_connections == 1  # a body read to its end, paused or not, keeps the socket

    resp = await req(pool, timeout=10)
    data = await resp.read()
    resp.release()
    assert hashlib.sha256(data).digest() == hashlib.sha256(big).digest()
    assert srv.accepted == 1


async def test_body_taken_while_paused_lets_the_rest_arrive(serve, pools) -> None:
    """``body()`` empties the buffer ('the body so far'): reading must resume, or the rest never comes."""
    big = random.Random(3).randbytes(3 << 20)
    srv = await serve(each_request(answer(big)))
    pool = pools(srv.url)
    resp = await req(pool, timeout=0.5)
    await wait_until(lambda: resp._buffered > upstream.HIGH_WATER, timeout=1, step=0.005)
    first = resp.body()
    assert 0 < len(first) < len(big)
    rest = await resp.read()
    assert first + rest == big
    resp.release()


async def test_complete_answer_taken_with_body_leaves_a_usable_connection(serve, pools) -> None:
    """The relay's fast path (``complete`` → ``body()`` → ``release()``) on an answer just over the
    high-water mark: the pooled socket must still read the next answer."""
    big = random.Random(5).randbytes(upstream.HIGH_WATER + 1)
    srv = await serve(each_request(answer(big), answer(b"small")))
    pool = pools(srv.url)
    resp = await req(pool, timeout=1.0)
    await wait_until(lambda: resp.complete, timeout=1, step=0.005)
    assert resp.body() == big
    resp.release()
    status, body = await fetch(pool, timeout=0.5)
    assert (status, body) == (200, b"small")


# --- pool lifecycle ----------------------------------------------------------------------------------


async def test_release_before_the_body_ended_closes_the_connection(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(answer(b"0123456789", content_length=1000))  # the rest would follow later

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool)
    assert resp.status == 200
    resp.release()
    resp.release()  # twice is harmless
    await socket_dropped(srv, pool)
    resp2 = await req(pool)
    assert resp2.status == 200
    resp2.release()
    assert srv.accepted == 2


async def test_release_right_after_headers_of_a_complete_answer_reuses(serve, pools) -> None:
    """An unread but fully arrived body does not stop reuse (the buffer is simply dropped)."""
    srv = await serve(each_request(answer(b"unread")))
    pool = pools(srv.url)
    resp = await req(pool)
    await wait_until(lambda: resp.complete, timeout=1, step=0.005)
    resp.release()
    assert await fetch(pool) == (200, b"unread")
    assert srv.accepted == 1


async def test_concurrent_requests_use_separate_connections_then_reuse_them(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await asyncio.sleep(0.05)
            await peer.send(answer(b"c%d" % peer.index))

    srv = await serve(handler)
    pool = pools(srv.url)
    res = await asyncio.gather(*[fetch(pool) for _ in range(3)])
    assert sorted(b for _, b in res) == [b"c0", b"c1", b"c2"]
    assert srv.accepted == 3
    assert pool.open_connections == 3
    res = await asyncio.gather(*[fetch(pool) for _ in range(3)])
    assert srv.accepted == 3
    assert sorted(b for _, b in res) == [b"c0", b"c1", b"c2"]


async def test_idle_sockets_beyond_max_idle_are_closed(serve, pools, monkeypatch) -> None:
    monkeypatch.setattr(upstream, "MAX_IDLE", 1)

    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await asyncio.sleep(0.03)
            await peer.send(answer(b"ok"))

    srv = await serve(handler)
    pool = pools(srv.url)
    await asyncio.gather(fetch(pool), fetch(pool))
    assert srv.accepted == 2
    assert len(pool.idle) == 1
    await wait_until(lambda: sum(p.client_closed.is_set() for p in srv.peers) == 1, timeout=1, step=0.005)
    assert pool.open_connections == 1


async def test_close_idle_closes_idle_sockets_and_refuses_new_requests(serve, pools) -> None:
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")
    assert pool.open_connections == 1
    pool.close_idle()
    await socket_dropped(srv, pool)
    with pytest.raises(ConnectFailed):
        await req(pool)
    assert srv.accepted == 1


async def test_close_idle_lets_a_busy_exchange_finish_then_closes_it(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await peer.send(answer(b"slow body", headers=("X-A: 1",))[:-4])
            await asyncio.sleep(0.1)
            await peer.send(b"body")

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool)
    pool.close_idle()
    assert await resp.read() == b"slow body"
    resp.release()
    await socket_dropped(srv, pool)


async def test_close_aborts_a_busy_exchange(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(answer(b"partial", content_length=1000))

    srv = await serve(handler)
    pool = pools(srv.url)
    resp = await req(pool, timeout=5)
    pool.close()
    async with asyncio.timeout(1):
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    resp.release()
    await socket_dropped(srv, pool)


async def test_close_while_waiting_for_headers_fails_the_request(serve, pools) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()  # never answers

    srv = await serve(handler)
    pool = pools(srv.url)
    task = asyncio.create_task(req(pool, timeout=5))
    await wait_until(lambda: srv.accepted == 1 and srv.peers[0].got_request.is_set(), timeout=2, step=0.005)
    pool.close()
    async with asyncio.timeout(1):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await task
    await socket_dropped(srv, pool)


async def test_idle_sockets_are_closed_after_idle_keep_sec(serve, pools, monkeypatch) -> None:
    monkeypatch.setattr(upstream, "IDLE_KEEP_SEC", 0.2)
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")
    assert pool.open_connections == 1
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await closed_by_client(srv.peers[0], timeout=1.5)
    assert loop.time() - t0 >= 0.15
    assert pool.open_connections == 0
    assert pool.idle == []
    assert await fetch(pool) == (200, b"ok")  # the pool goes on with a new socket
    assert srv.accepted == 2


async def test_expired_idle_socket_is_not_taken(serve, pools, monkeypatch) -> None:
    """Past IDLE_KEEP_SEC a pooled socket is dropped when taken, even before the pruning timer ran."""
    srv = await serve(each_request(answer(b"ok")))
    pool = pools(srv.url)
    assert await fetch(pool) == (200, b"ok")  # pruning scheduled 30 s out
    monkeypatch.setattr(upstream, "IDLE_KEEP_SEC", 0.05)
    await asyncio.sleep(0.1)
    assert await fetch(pool) == (200, b"ok")
    assert srv.accepted == 2
    await closed_by_client(srv.peers[0])
    assert pool.open_connections == 1


# --- the deadline buckets ---------------------------------------------------------------------------


class _Exchange:
    """Stands in for an UpstreamResponse: records when its deadline fired."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, fired: list[tuple[str, float]]):
        self.loop, self.name, self.fired = loop, name, fired

    def expire(self) -> None:
        self.fired.append((self.name, self.loop.time()))


async def test_deadlines_fire_in_order_at_most_a_grain_late_and_removed_ones_never() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    fired: list[tuple[str, float]] = []
    t0 = loop.time()
    want = {"a": 0.30, "b": 0.12, "c": 0.12, "d": 0.20, "gone": 0.15, "later-gone": 0.40}
    buckets = {n: d.add(_Exchange(loop, n, fired), t0 + dt) for n, dt in want.items()}  # type: ignore[arg-type]
    # Removing needs the same object that was added: look it up by name in its bucket.
    for name in ("gone", "later-gone"):
        (ex,) = [e for e in d.buckets[buckets[name]] if e.name == name]  # type: ignore[attr-defined]
        d.discard(ex, buckets[name])  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    names = [n for n, _ in fired]
    assert sorted(names) == ["a", "b", "c", "d"]
    assert names.index("b") < names.index("d") < names.index("a")
    for name, at in fired:
        late = at - (t0 + want[name])
        assert -0.002 <= late <= d.tick + 0.05, (name, late)  # never early; at most a grain (plus a busy box)
    assert d.buckets == {} and d.timer is None  # nothing left armed once every exchange is done


async def test_deadlines_an_earlier_deadline_rearms_the_timer() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines()
    fired: list[tuple[str, float]] = []
    t0 = loop.time()
    d.add(_Exchange(loop, "late", fired), t0 + 5.0)  # type: ignore[arg-type]
    d.add(_Exchange(loop, "soon", fired), t0 + 0.1)  # type: ignore[arg-type]
    await asyncio.sleep(0.3)
    assert [n for n, _ in fired] == ["soon"]
    assert d.timer is not None  # still armed for "late"
    d.close()
    assert d.timer is None


# --- TLS nodes (RunPod / Vast.ai proxies give https URLs) ---------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = str(tmp_path / "node.crt"), str(tmp_path / "node.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=node",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key


async def _tls_server(cert: str, key: str) -> RawServer:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    srv = RawServer(each_request(answer(b"secure")))
    srv.tls = ctx
    await srv.start()
    return srv


async def test_https_node_is_verified_and_reused(pools, tmp_path, monkeypatch) -> None:
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # trust our self-signed node, as a CA bundle would
    srv = await _tls_server(cert, key)
    try:
        pool = pools(srv.url)
        for _ in range(2):
            r = await req(pool)
            assert r.status == 200 and await r.read() == b"secure"
            r.release()
        assert srv.accepted == 1  # the TLS connection was kept alive and reused
    finally:
        await srv.stop()


async def test_https_node_with_an_untrusted_certificate_is_a_connect_failure(pools, tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = await _tls_server(cert, key)
    try:
        with pytest.raises(ConnectFailed):
            await req(pools(srv.url))
    finally:
        await srv.stop()


# --- a node's response head is capped (docs/SECURITY.md) -----------------------------------------


def endless_headers(line: bytes = b"X-Flood: " + b"a" * 40 + b"\r\n") -> Handler:
    """A hostile node: a status line, then header lines for as long as anyone reads them."""

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\n")
        try:
            while True:
                await peer.send(line * 100)
        except ConnectionError:
            peer.client_closed.set()

    return handler


@pytest.mark.parametrize("line", [b"X-Flood: " + b"a" * 40 + b"\r\n",  # many lines
                                  b"a" * 1000],  # one header that never ends
                         ids=["lines", "one-long-value"])
async def test_endless_response_head_is_a_node_failure(serve, pools, line: bytes) -> None:
    srv = await serve(endless_headers(line) if line.endswith(b"\r\n") else _one_long_header(line))
    pool = pools(srv.url)
    async with asyncio.timeout(5):
        with pytest.raises(aiohttp.ServerDisconnectedError) as ei:
            await req(pool)
    assert isinstance(ei.value, upstream.HeadTooLarge)
    await wait_until(lambda: pool.open_connections == 0, timeout=2, step=0.005)
    await asyncio.wait_for(srv.peers[0].client_closed.wait(), 2)  # the socket was closed, not drained


def _one_long_header(chunk: bytes) -> Handler:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\nX-Long: ")
        try:
            while True:
                await peer.send(chunk * 64)
        except ConnectionError:
            peer.client_closed.set()

    return handler


async def test_heads_up_to_the_cap_pass(serve, pools) -> None:
    # 250 header lines (the cap is 256, Content-Length included) and 60 KiB: normal traffic untouched.
    lines = tuple(f"X-H{i}: {'v' * 230}" for i in range(250))
    srv = await serve(each_request(answer(b"ok", headers=lines)))
    pool = pools(srv.url)
    status, body = await fetch(pool, "/")
    assert (status, body) == (200, b"ok")
    resp = await req(pool)
    assert len(resp.raw_headers) == 251
    resp.release()


async def test_257_header_lines_are_refused(serve, pools) -> None:
    lines = tuple(f"X-H{i}: v" for i in range(256))  # + Content-Length = 257
    srv = await serve(each_request(answer(b"ok", headers=lines)))
    pool = pools(srv.url)
    with pytest.raises(upstream.HeadTooLarge):
        await req(pool)


async def test_header_bytes_over_0x80_decode_without_surrogates(serve, pools) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/\xffplain\xe9\r\nX-Ok: caf\xc3\xa9\r\nContent-Length: 0\r\n\r\n"
    srv = await serve(each_request(raw))
    pool = pools(srv.url)
    resp = await req(pool)
    ct = resp.headers["Content-Type"]
    assert ct == "text/\xffplain\xe9"  # latin-1: one character per byte
    ct.encode("utf-8")  # no lone surrogate (orjson, aiohttp's writer and logging all choke on one)
    assert resp.headers["X-Ok"] == "café"  # valid UTF-8 stays as sent
    resp.release()
