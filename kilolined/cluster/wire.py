"""One pipelined connection to Redis for the lease scripts, replies handled as they arrive.

Every lease decision is a script call (kilolined/cluster/scripts.py), and a freed slot is handed
on by the answer of one: that round trip is the cluster's dispatch gap. redis-py's asyncio
client spends ~0.2 ms of CPU and several loop turns per call (pool lock and condition, health
check, timeouts, observability hooks); here a call is written to the socket in the caller's own
turn and its future is resolved from ``data_received``, in Redis' reply order. The connection
itself (TLS, AUTH, SELECT: whatever ``cluster.redis_url`` says) is made by redis-py, then its
transport is taken over. Errors are redis-py's own exception classes, so callers handle an
outage, a refusal or a stale epoch as before.

A call not answered within ``timeout`` closes the connection: every call on it fails with
``TimeoutError`` (a ``RedisError``), as redis-py's ``socket_timeout`` would; the next call
connects again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

Push = Callable[[list[Any]], None]


def encode(*parts: str | int | float | bytes) -> bytes:
    """One command in RESP."""
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Call:
    __slots__ = ("at", "fut", "retry")

    def __init__(self, fut: asyncio.Future[Any], retry: tuple[Any, ...] | None, at: float):
        self.fut = fut
        self.retry = retry  # the same call's parts as EVAL with the script's source (after NOSCRIPT)
        self.at = at


class _Proto(asyncio.Protocol):
    """The taken-over transport's protocol: replies to the oldest pending call, or pushes."""

    def __init__(self, wire: Wire, transport: asyncio.WriteTransport, conn: Any):
        self.wire = wire
        self.conn = conn  # redis-py's connection closes the transport when it is collected
        self.transport = transport
        self.reader = hiredis.Reader(replyError=BaseParser.parse_error)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        wire = self.wire
        while (reply := self.reader.gets()) is not False:
            wire._reply(self, reply)

    def close(self) -> None:
        self.conn._close()  # closes the transport, and redis-py's connection knows it is closed

    def eof_received(self) -> bool | None:
        return None  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.wire._gone(self, exc)


class Wire:
    """A pipelined Redis connection made from ``pool``'s settings; see the module docstring.

    ``on_push`` set: a subscriber connection, whose pub/sub messages go to it as they arrive."""

    def __init__(self, pool: aioredis.ConnectionPool, timeout: float, on_push: Push | None = None,
                 on_lost: Callable[[], None] | None = None, scripts: Sequence[str] = ()):
        self.pool = pool
        #: loaded first on every connection: a script's first call is not the round trip that
        #: learns NOSCRIPT and sends its source (the answer that hands a slot on waits for it)
        self.scripts = tuple(scripts)
        self.timeout = timeout
        self.on_push = on_push
        self.on_lost = on_lost  # the connection ended (a subscriber subscribes again)
        self._shas: dict[str, str] = {}
        self._proto: _Proto | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._pending: deque[_Call] = deque()
        self._queued: list[bytes] = []  # written once the connection is made
        self._watch: asyncio.TimerHandle | None = None
        self.closed = False

    # --- calls ------------------------------------------------------------------------------
    def evalsha(self, source: str, keys: list[str], args: Sequence[str | int | float]) -> asyncio.Future[Any]:
        """Run a script; the future holds its answer. Written now if connected."""
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        return self._send(encode(b"EVALSHA", sha, len(keys), *keys, *args), (b"EVAL", source, len(keys), *keys, *args))

    def command(self, *parts: str | int | bytes) -> asyncio.Future[Any]:
        return self._send(encode(*parts), None)

    def _send(self, cmd: bytes, retry: tuple[Any, ...] | None) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.closed:
            fut.set_exception(RedisConnectionError("the Redis wire is closed"))
            return fut
        self._pending.append(_Call(fut, retry, time.monotonic()))
        if self._proto is not None:
            self._proto.transport.write(cmd)
        else:
            self._queued.append(cmd)
            if self._connecting is None:
                self._connecting = loop.create_task(self._connect())
        self._arm()
        return fut

    # --- the connection -----------------------------------------------------------------------
    async def _connect(self) -> None:
        pool: Any = self.pool  # make_connection is untyped in redis-py
        conn = pool.make_connection()
        try:
            await conn.connect()  # TLS, AUTH, SELECT, the health check: redis-py's handshake
            writer = conn._writer
            assert writer is not None
            transport = writer.transport
            proto = _Proto(self, transport, conn)
            transport.set_protocol(proto)
        except asyncio.CancelledError:
            self._connecting = None
            self._fail(RedisConnectionError("the Redis wire is closed"))
            raise
        except Exception as e:  # redis-py's ConnectionError, TimeoutError, AuthenticationError, …
            self._connecting = None
            self._fail(e)
            return
        self._connecting = None
        if self.closed:
            proto.close()
            return
        self._proto = proto
        loads, calls = [], []
        for src in self.scripts:  # answered first: their calls go in front of the queued ones
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_ignored)
            calls.append(_Call(fut, None, time.monotonic()))
            loads.append(encode(b"SCRIPT", b"LOAD", src))
        self._pending.extendleft(reversed(calls))
        queued, self._queued = self._queued, []
        if loads or queued:
            transport.write(b"".join([*loads, *queued]))

    async def connected(self) -> None:
        """Connect now (a subscriber's first step); raises what connecting raised."""
        if self._proto is not None:
            return
        fut = self.command(b"PING")
        await fut

    def _reply(self, proto: _Proto, reply: Any) -> None:
        if proto is not self._proto:
            return
        if self.on_push is not None and isinstance(reply, list) and reply and reply[0] == b"message":
            self.on_push(reply)
            return
        if not self._pending:
            return  # a subscription's confirmation with no call waiting for it
        call = self._pending.popleft()
        if isinstance(reply, NoScriptError) and call.retry is not None:
            # Redis lost its script cache (SCRIPT FLUSH): the same call again with the source,
            # answered after every call written before it.
            self._pending.append(_Call(call.fut, None, time.monotonic()))
            proto.transport.write(encode(*call.retry))
            return
        if call.fut.done():
            return
        if isinstance(reply, Exception):
            call.fut.set_exception(reply)
        else:
            call.fut.set_result(reply)

    def _gone(self, proto: _Proto, exc: Exception | None) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        proto.close()
        self._fail(RedisConnectionError(f"Redis connection lost ({exc or 'closed by the server'})"))
        if self.on_lost is not None:
            self.on_lost()

    def _fail(self, e: Exception) -> None:
        pending, self._pending = self._pending, deque()
        self._queued = []
        for call in pending:
            if not call.fut.done():
                call.fut.set_exception(e)
                call.fut.exception()  # a caller that left does not make it "never retrieved"

    # --- the timeout ------------------------------------------------------------------------
    def _arm(self) -> None:
        if self._watch is None and self._pending:
            self._watch = asyncio.get_running_loop().call_later(self.timeout / 4, self._check)

    def _check(self) -> None:
        """One timer for every call: the oldest one unanswered past ``timeout`` ends the connection."""
        self._watch = None
        if self._pending and time.monotonic() - self._pending[0].at > self.timeout:
            proto, self._proto = self._proto, None
            if proto is not None:
                proto.close()
            self._fail(RedisTimeoutError(f"Redis did not answer within {self.timeout:g}s"))
            if proto is not None and self.on_lost is not None:
                self.on_lost()
            return
        self._arm()

    def close(self) -> None:
        self.closed = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.close()
        if self._connecting is not None:
            self._connecting.cancel()
        self._fail(RedisConnectionError("the Redis wire is closed"))


def _ignored(fut: asyncio.Future[Any]) -> None:
    """A script load's answer: an error (an ACL that refuses SCRIPT) leaves the EVAL fallback."""
    if not fut.cancelled():
        fut.exception()


async def subscribed(pool: aioredis.ConnectionPool, timeout: float, channel: str, on_push: Push,
                     ending: Callable[[Callable[[], None]], None] = lambda end: None,
                     on_subscribed: Callable[[], None] = lambda: None) -> None:
    """One subscription to ``channel`` on a connection of its own, its messages to ``on_push`` as
    they arrive; returns when that connection is lost (the caller subscribes again), raises when
    it cannot subscribe. ``ending`` is given, before the SUBSCRIBE is sent, the call that ends
    this subscription early (a resubscribe asked for meanwhile is not missed); ``on_subscribed``
    is called once Redis has confirmed it."""
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def end() -> None:
        if not lost.done():
            lost.set_result(None)

    sub = Wire(pool, timeout, on_push=on_push, on_lost=end)
    ending(end)
    try:
        await sub.command("SUBSCRIBE", channel)
        on_subscribed()
        await lost
    finally:
        sub.close()
