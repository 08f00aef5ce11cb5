"""The forwarding hot path's HTTP/1.1 client: one keep-alive pool per node, asyncio protocols
parsed by httptools (llhttp, Node.js's parser, in C).

Why not aiohttp's client here: against a zero-delay node the gateway spent ~27 % of its CPU in
``ClientSession.request`` alone (docs/BENCHMARKS.md §1, "Where the CPU goes") — timeouts objects, tracing hooks,
cookie and redirect machinery, a StreamReader per response — for an exchange that is one write
and one parse. This client does exactly what a reverse proxy needs: send the request in one
write, hand back the status and headers, then the body as it arrives, with back-pressure, and
put the connection back when the body ended cleanly. aiohttp's client stays for everything else
(websockets, ComfyUI's side calls, health checks, webhooks, notifiers).

Errors keep aiohttp's exception types so every caller's ``except`` stays as it is:
``ConnectFailed`` (an OSError) when no connection could be made, ``aiohttp.ServerDisconnectedError``
when the node hung up before the headers (or sent a head over MAX_HEAD_BYTES / MAX_HEAD_LINES),
``aiohttp.ClientPayloadError`` when it hung up (or broke HTTP) mid-body,
``TimeoutError`` when the exchange outlived its deadline.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import cast

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from kilolined.wire.deadlines import Deadlines

HIGH_WATER = 1 << 20  # stop reading from the node while this much body waits for a slow client
LOW_WATER = 1 << 18
IDLE_KEEP_SEC = 30.0  # like aiohttp's keepalive_timeout: idle sockets to a node are closed after this
MAX_IDLE = 512
# A node's response head is capped like nginx's proxy_buffer_size / HAProxy's tune.bufsize: a
# node that sends endless headers is a node failure, never gateway memory or a client's problem.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEAD_LINES = 256
# Methods whose requests carry content: they get a Content-Length even when it is 0 (RFC 9110
# §8.6). A body-less GET, DELETE, OPTIONS or TRACE gets none, as the client sent it.
CONTENT_METHODS = frozenset(("POST", "PUT", "PATCH"))
Headers = Iterable[tuple[str, str]] | Mapping[str, str]  # name/value pairs (repeats kept), or a mapping


class ConnectFailed(OSError):
    """No connection to the node (refused, unreachable, DNS, TLS handshake)."""


class HeadTooLarge(aiohttp.ServerDisconnectedError):
    """The node's response head outgrew MAX_HEAD_BYTES or MAX_HEAD_LINES: a node failure, handled
    wherever a node that hung up before answering is."""


class Stalled(TimeoutError):
    """No byte from the node for ``idle_sec`` while its answer streamed (a stall: the slow-node
    watch ejects the node, docs/CONFIG.md "Slow nodes")."""


STALLED = "stalled"  # the first word of a stall's reason, for people; code reads core.verdict.Cause.STALL


class UpstreamResponse:
    """One exchange on one pooled connection; the subset of ``aiohttp.ClientResponse`` we use.

    It is also the parser's callback object: httptools calls ``on_*`` as bytes arrive.
    """

    __slots__ = (
        "_blocked",
        "_bucket",
        "_buffered",
        "_chunked",
        "_chunks",
        "_conn",
        "_eof",
        "_error",
        "_got_bytes",
        "_head",
        "_head_bytes",
        "_headers",
        "_keep_alive",
        "_loop",
        "_method",
        "_parser",
        "_push",
        "_push_exc",
        "_released",
        "_stall_timer",
        "_until_close",
        "_wait_since",
        "_waiter",
        "content_length",
        "idle_sec",
        "raw_headers",
        "reason",
        "status",
    )

    def __init__(self, conn: _Conn, method: str, deadline: float):
        loop = conn.loop
        self.status = 0
        self.reason = ""
        self.raw_headers: list[tuple[str, str]] = []
        self.content_length: int | None = None
        self._headers: CIMultiDictProxy[str] | None = None
        self._conn = conn
        self._method = method
        self._loop = loop
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._until_close = False
        self._keep_alive = False
        self._released = False
        self._got_bytes = False
        self._head_bytes = 0  # head bytes so far, 1xx interim answers included
        self._chunked = False
        self._bucket: int | None = conn.pool.deadlines.add(self, deadline)  # its deadline bucket
        #: set by the attempt on a streamed answer: the longest silence between two pieces
        self.idle_sec: float | None = None
        # The stall watch (idle_sec): when the current wait for a piece began, and one timer per
        # exchange that checks it lazily (_stall_check), never one timer per piece.
        self._wait_since = 0.0
        self._stall_timer: asyncio.TimerHandle | None = None
        # relay(): where each piece goes from the parser's callback (set only while relay waits
        # with nothing buffered, its client not full and the body not ended: on_body's one
        # test), what it raised, and whether the client behind it is full (the node socket is
        # paused until it drains)
        self._push: Callable[[bytes], bool] | None = None
        self._push_exc: Exception | None = None
        self._blocked = False

    # --- what callers read -------------------------------------------------------------
    @property
    def headers(self) -> CIMultiDictProxy[str]:
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(self.raw_headers))
        return self._headers

    @property
    def content_type(self) -> str:
        """``headers.get("Content-Type", "")``, read off the head without building ``headers``
        (a multidict of every header, for one lookup per request)."""
        for k, v in self.raw_headers:
            if len(k) == 12 and k.lower() == "content-type":
                return v
        return ""

    @property
    def content(self) -> UpstreamResponse:
        """aiohttp's ``resp.content.iter_any()`` spelling works on this object too."""
        return self

    @property
    def complete(self) -> bool:
        """The whole body is here (small answers usually arrive with their headers)."""
        return self._eof and self._error is None

    def body(self) -> bytes:
        """The body so far, taken out of the buffer (all of it when ``complete``)."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self._next()
            if not chunk:
                return
            yield chunk

    async def read(self) -> bytes:
        parts = []
        while chunk := await self._next():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the exchange: the connection goes back to the pool if the body ended cleanly."""
        if self._released:
            return
        self._released = True
        self._stop_timer()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        conn = self._conn
        conn.resp = None
        self._parser = None  # the parser points back at us: break the cycle, let refcounting free both
        if self._eof and self._error is None and self._keep_alive and not conn.closed:
            conn.pool.put_idle(conn)
        else:
            conn.close()

    # --- the exchange --------------------------------------------------------------------
    async def wait_head(self) -> None:
        try:
            await self._head
        except BaseException:
            self.release()  # a half-done exchange never goes back to the pool
            raise

    async def _next(self) -> bytes:
        while True:
            if self._chunks:
                # Everything buffered, in one piece: a slow client then gets fewer, larger writes.
                chunk = self._chunks.popleft() if len(self._chunks) == 1 else self.body()
                self._buffered = 0
                self._conn.resume()
                return chunk
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            await self._wait()

    async def ready(self) -> None:
        """Wait for the body's first piece without taking it, at most ``idle_sec`` (Stalled):
        a streamed answer that stalls before its first byte can still be re-queued."""
        while not self._chunks and self._error is None and not self._eof:
            await self._wait()

    async def _wait(self) -> None:
        """Until the node sends more (or fails, or ends); with ``idle_sec`` set, Stalled once it
        has sent nothing for that long since this wait began."""
        loop = self._loop
        self._waiter = waiter = loop.create_future()
        if self.idle_sec is not None:
            # A relayed token is one wait: the stall clock restarts here (a float), and the one
            # timer of the exchange is armed only when none is (_stall_check re-arms it lazily).
            self._wait_since = now = loop.time()
            if self._stall_timer is None:
                self._stall_timer = loop.call_at(now + self.idle_sec, self._stall_check)
        try:
            await waiter
        finally:
            self._waiter = None

    def _stall_check(self) -> None:
        """The stall timer: a wait older than ``idle_sec`` fails Stalled; a younger one gets the
        timer again at its own due time; with no wait in progress the next wait arms it."""
        self._stall_timer = None
        waiter, idle = self._waiter, self.idle_sec
        if waiter is None or waiter.done() or idle is None or self._released:
            return
        loop = self._loop
        due = self._wait_since + idle
        if loop.time() < due:
            self._stall_timer = loop.call_at(due, self._stall_check)
            return
        waiter.set_exception(Stalled(f"{STALLED}: no byte from the node for {idle:g}s"))

    # aiohttp's ``resp.content.readany()`` spelling: the next piece of body, b"" at its end. A
    # relay loop on it has no async-generator layer per chunk (iter_any's).
    readany = _next

    async def relay(self, push: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]) -> None:
        """The rest of the body to ``push``, each piece handed over in the connection's own
        callback as it arrives: no future, task wake-up or coroutine resumed per piece (a token
        stream is thousands of small pieces a second). Returns when the body ended; raises what
        ``_next`` would (the node's error, the deadline, Stalled) and what ``push`` raised.

        ``push(data)`` returns True when its client is full: the node socket is paused and
        ``drain()`` awaited before the next piece (pieces that arrive meanwhile wait here, as
        with ``_next``). The stall clock restarts with every piece pushed."""
        conn = self._conn
        while True:
            exc = self._push_exc
            if exc is not None:
                raise exc
            if self._blocked:
                await drain()
                self._blocked = False
                conn.resume()
                continue
            if self._chunks:
                data = self.body()  # what arrived before the relay, or while its client was full
                if push(data):
                    self._blocked = True
                    conn.pause()
                continue
            if self._error is not None:
                raise self._error
            if self._eof:
                return
            self._push = push  # on_body hands each piece over while this waits
            try:
                await self._wait()
            finally:
                self._push = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._eof or self._error is not None:
            return
        self._error = exc
        self._stop_timer()
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: the caller may already be gone (cancelled)
        self._wake()

    def _stop_timer(self) -> None:
        if self._bucket is not None:
            self._conn.pool.deadlines.discard(self, self._bucket)
            self._bucket = None

    def expire(self) -> None:
        """Its deadline passed (called by the pool's Deadlines)."""
        self._bucket = None
        self._fail(TimeoutError())
        self._conn.close()

    def feed(self, data: bytes) -> None:
        self._got_bytes = True
        parser = self._parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
            if not self._head.done() and self._error is None:
                # Everything fed so far is head: no body byte comes before the head is complete.
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._head_too_large()
        except httptools.HttpParserUpgrade:
            # 101 Switching Protocols on a forwarded request: not HTTP any more, cannot relay here.
            self._fail(aiohttp.ClientPayloadError("the node switched protocols"))
            self._conn.close()
        except httptools.HttpParserError as e:
            err: BaseException = (aiohttp.ClientPayloadError(f"bad HTTP from node ({e})") if self._head.done()
                                  else aiohttp.ServerDisconnectedError(f"bad HTTP from node ({e})"))
            self._fail(err)
            self._conn.close()

    def lost(self) -> None:
        if self._head.done() and not self._eof and self._error is None and self._until_close:
            self._eof = True  # a body delimited by the connection's end, and it ended
            self._stop_timer()
            self._wake()
            return
        if self._head.done():
            self._fail(aiohttp.ClientPayloadError("connection lost mid-body"))
        else:
            self._fail(aiohttp.ServerDisconnectedError("connection lost before the response"))

    # --- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.status:
            # A second answer nobody asked for, in the same read: the node is out of step. Ours is
            # complete and stays as it was; the socket is not reused.
            self._keep_alive = False

    def on_status(self, reason: bytes) -> None:
        if not self.status:
            self.reason = reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called for every header of every answer: kept short. The line limit is checked once the
        # head is complete (feed bounds its bytes, so the list stays small meanwhile).
        if self.status or self._error is not None:
            return
        n = len(name)
        if n == 14 or n == 17:  # len("content-length"), len("transfer-encoding"): the framing headers
            lname = name.lower()
            if lname == b"content-length" and value.strip().isdigit():
                self.content_length = int(value)
            elif lname == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
        # The value as text, never failing: UTF-8 when it is (aiohttp writes headers back as UTF-8,
        # so a relayed value keeps its bytes), else latin-1 (one char per byte, no surrogates that
        # would break a JSON encoder downstream).
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = value.decode("latin-1")
        self.raw_headers.append((name.decode("latin-1"), text))

    def _head_too_large(self) -> None:
        self.raw_headers = []
        # nginx's words for it: "upstream sent too big header"
        self._fail(HeadTooLarge(f"the node sent too big a response head (over {MAX_HEAD_BYTES // 1024} KiB "
                                f"or {MAX_HEAD_LINES} lines)"))
        self._conn.close()

    def on_headers_complete(self) -> None:
        if self.status or self._error is not None:
            return
        assert self._parser is not None
        status = self._parser.get_status_code()
        if status < 200:
            # 1xx interim answer (100 Continue, 103 Early Hints): the real one follows.
            self.raw_headers = []
            self.reason = ""
            self.content_length = None
            self._chunked = False
            return
        if len(self.raw_headers) > MAX_HEAD_LINES:
            self._head_too_large()
            return
        self.status = status
        chunked = self._chunked
        self._keep_alive = bool(self._parser.should_keep_alive())
        no_body = self._method == "HEAD" or status in (204, 304)
        self._until_close = not no_body and not chunked and self.content_length is None
        if self._method == "HEAD":
            # llhttp does not know the request was HEAD and would wait for Content-Length bytes:
            # the exchange ends here and the connection is not reused.
            self._eof = True
            self._keep_alive = False
            self._stop_timer()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        push = self._push
        if push is not None:
            # relay(): straight on to the client, from this callback (the per-token path)
            try:
                full = push(body)
            except Exception as e:  # the client gone, or an observer's fault: relay() raises it
                self._push = None
                self._push_exc = e
                self._wake()
                return
            self._wait_since = self._loop.time()  # a piece came: the stall clock restarts
            if full:
                self._push = None
                self._blocked = True
                self._conn.pause()
                self._wake()
            return
        if self._eof or not self.status:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status == 0 or self._eof:
            return  # the end of a 1xx interim answer (or of a HEAD's headers)
        self._eof = True
        self._push = None  # a second answer in the same read never reaches relay()'s client
        self._stop_timer()
        self._wake()


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection to a node; serves one exchange at a time."""

    def __init__(self, pool: NodePool, loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:
            self.close()  # bytes nobody asked for: the node is out of step, never reuse this socket
            return
        r.feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool.forget(self)
        r = self.resp
        if r is not None:
            r.lost()

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if len(body) <= 65536:
            self.transport.write(head + body)  # one segment for the usual small JSON request
        else:
            self.transport.writelines((head, body))

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool.forget(self)


class NodePool:
    """Keep-alive connections to one node URL (``http(s)://[user:pw@]host:port[/base]``)."""

    def __init__(self, url: str):
        u = URL(url)
        self.host = u.raw_host or ""
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.base_path = u.raw_path.rstrip("/")
        self.auth: str | None = None
        if u.user is not None:
            cred = f"{u.user}:{u.password or ''}".encode()
            self.auth = "Basic " + base64.b64encode(cred).decode()
        self.idle: list[_Conn] = []
        self.busy: set[_Conn] = set()
        self.closed = False
        self._prune: asyncio.TimerHandle | None = None
        self.deadlines = Deadlines()  # every exchange's deadline (kilolined/wire/deadlines.py)

    async def request(self, method: str, tail: str, headers: Headers, body: bytes,
                      timeout: float, sent: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send one request; returns once the status line and headers are in.

        ``timeout`` bounds the whole exchange, body included (as aiohttp's ``total``): reading
        the body after the deadline raises TimeoutError. A reused keep-alive socket that the node
        had already closed is retried once on a fresh one (nothing reached the node). ``sent`` is
        called once the request is written.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        head = self._render(method, tail, headers, body)
        while True:
            conn = self._take_idle(loop)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(loop, min(timeout, 10.0))
            resp = UpstreamResponse(conn, method, deadline)
            conn.resp = resp
            self.busy.add(conn)
            conn.send(head, body)
            if sent is not None:
                sent()
            try:
                await resp._head  # wait_head, inline: one coroutine less per request
            except BaseException as e:
                resp.release()  # a half-done exchange never goes back to the pool
                if isinstance(e, aiohttp.ServerDisconnectedError) and reused and not resp._got_bytes \
                        and loop.time() < deadline:
                    continue  # the stale keep-alive race: the node had closed this socket
                raise
            return resp

    def _render(self, method: str, tail: str, headers: Headers, body: bytes) -> bytes:
        lines = [f"{method} {self.base_path}{tail} HTTP/1.1"]
        # map(": ".join, pairs): each "Name: value" line built in C, not one f-string per header
        lines += map(": ".join, headers if isinstance(headers, list) else
                     headers.items() if isinstance(headers, Mapping) else headers)
        if self.auth is not None and not any(line[:14].lower() == "authorization:" for line in lines):
            lines.append(f"Authorization: {self.auth}")
        if body or method in CONTENT_METHODS:
            lines.append(f"Content-Length: {len(body)}")
        head = "\r\n".join(lines)
        # A line break inside a name or value would smuggle a header or a second request.
        if head.count("\n") != len(lines) - 1 or head.count("\r") != len(lines) - 1:
            raise ValueError("a header has a line break")
        return (head + "\r\n\r\n").encode("utf-8", "surrogateescape")

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> _Conn:
        if self.closed:
            raise ConnectFailed("the node's pool is closed (node removed)")
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self, loop), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None)
        except TimeoutError:
            raise
        except OSError as e:
            raise ConnectFailed(e.errno, e.strerror or type(e).__name__) from e
        return conn

    def _take_idle(self, loop: asyncio.AbstractEventLoop) -> _Conn | None:
        now = loop.time()
        while self.idle:
            conn = self.idle.pop()  # most recently used first: warm, least likely to be stale
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > IDLE_KEEP_SEC:
                conn.close()
                continue
            return conn
        return None

    def put_idle(self, conn: _Conn) -> None:
        self.busy.discard(conn)
        if self.closed or len(self.idle) >= MAX_IDLE:
            conn.close()
            return
        conn.resume()  # a body that ended exactly at the high-water mark left the socket paused
        conn.idle_since = conn.loop.time()
        self.idle.append(conn)
        if self._prune is None:
            self._prune = conn.loop.call_later(IDLE_KEEP_SEC, self._prune_idle, conn.loop)

    def _prune_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        self._prune = None
        cutoff = loop.time() - IDLE_KEEP_SEC
        keep = []
        for c in self.idle:
            if c.idle_since <= cutoff:
                c.close()
            elif not c.closed:
                keep.append(c)
        self.idle = keep
        if keep:
            self._prune = loop.call_later(IDLE_KEEP_SEC / 2, self._prune_idle, loop)

    def forget(self, conn: _Conn) -> None:
        self.busy.discard(conn)
        # Closed idle sockets are skipped (and dropped) by _take_idle / _prune_idle.

    def close_idle(self) -> None:
        """Stop taking new work: idle sockets close now, busy ones when their exchange ends."""
        self.closed = True
        if self._prune is not None:
            self._prune.cancel()
            self._prune = None
        for c in self.idle:
            c.close()
        self.idle = []

    def close(self) -> None:
        """Close everything, in-flight exchanges included (shutdown)."""
        self.close_idle()
        for c in list(self.busy):
            c.close()
        self.deadlines.close()

    @property
    def open_connections(self) -> int:
        return len(self.busy) + sum(1 for c in self.idle if not c.closed)
