"""The ComfyUI websocket over several gateways (cluster mode, docs/CLUSTER.md).

A browser's ``{path}/ws?clientId=X`` is a socket to one gateway, but a load balancer sends its
``POST /prompt`` to any gateway, and a prompt's events reach only the gateway that sent it to its
node (comfy_hub.py). So each gateway says in Redis which keys its sockets listen for, and the
gateway that runs a prompt publishes the prompt's frames to each gateway that listens for its key:

- ``{prefix}comfyws:{route}``: a hash, one field ``["{gateway instance}", "{key}"]`` per key with a
  socket on that gateway (``*``: the admin key, or a ``comfy.shared`` route: every key), valued
  with the Unix time in ms until which it holds; rewritten every ``BEAT_SEC`` while the sockets
  stay, deleted when the last one closes (a gateway that died is ignored from that time, and its
  field deleted by the next gateway that reads the hash).
- ``{prefix}comfyws:to:{gateway instance}``: the channel a gateway subscribes to once its first
  socket opens (before that socket's handshake ends, so a prompt posted next is heard).

A frame is published only to a gateway listening for the prompt's key, on one pipelined connection
of its own, in the order the frames came: a prompt's events arrive in order, and the gateway's
lease scripts never wait behind a preview. The receiving gateway hands each frame to its own
sockets as if its node had sent it (the client id and the key are checked there). Who listens is
read from Redis when a prompt is about to be sent, and at most every ``LOOK_SEC`` while frames
flow (a socket opened on another gateway mid-prompt hears it from then on).

The route's queue is the cluster's: each gateway publishes its own count of the route's prompts
not yet ended (per key) to the gateways that listen, when it changes and every ``BEAT_SEC`` while
it is not zero; a count not heard again within ``COUNTS_TTL_SEC`` is dropped (its gateway died).

A Redis that does not answer leaves each gateway's sockets with the prompts it runs (logged, never
an error to clients). Nothing of this runs in one-gateway mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster.wire import Wire, subscribed

log = logging.getLogger("kilolined")

CALL_SEC = 5.0
JOIN_SEC = 1.0  # a socket's handshake, or a prompt, waits this long at most for Redis (an outage: this gateway's own)
BEAT_SEC = 3.0  # the listeners' fields and the non-zero counts are written again this often
HOLD_SEC = 4 * BEAT_SEC  # a listener's field outlives its gateway this long at most
LOOK_SEC = 1.0  # who listens is read again at most this often while frames flow
COUNTS_TTL_SEC = 3 * BEAT_SEC
ALL = "*"  # a socket that hears every key's prompts
TEXT, BINARY, STATUS = b"t", b"b", b"s"
ERRORS = (RedisError, OSError, TimeoutError)

#: (route, owner key, target client id or None, frame) → this gateway's sockets
OnFrame = Callable[[str, str, "str | None", "str | bytes"], None]


def encode(kind: bytes, head: list[Any], payload: bytes) -> bytes:
    """One published message: its kind, a JSON header (no newline in it), a newline, the payload."""
    return kind + orjson.dumps(head) + b"\n" + payload


def decode(msg: bytes) -> tuple[bytes, list[Any], bytes] | None:
    head, sep, payload = msg[1:].partition(b"\n")
    if not sep:
        return None
    try:
        parsed = orjson.loads(head)
    except orjson.JSONDecodeError:
        return None
    return (msg[:1], parsed, payload) if isinstance(parsed, list) else None


def listeners(fields: dict[str, str], here: str, now_ms: float) -> dict[str, set[str]]:
    """A route's listeners hash as gateway instance → the keys it listens for: the expired ones
    and this gateway's own left out."""
    out: dict[str, set[str]] = {}
    for name, until in fields.items():
        try:
            inst, key = orjson.loads(name)
            alive = float(until) > now_ms
        except (orjson.JSONDecodeError, ValueError, TypeError):
            continue
        if alive and isinstance(inst, str) and isinstance(key, str) and inst != here:
            out.setdefault(inst, set()).add(key)
    return out


def expired(fields: dict[str, str], now_ms: float) -> list[str]:
    """The fields of gateways that stopped writing them (died without leaving): deleted by
    whoever reads them, so the hash does not grow with every gateway restart."""
    out = []
    for name, until in fields.items():
        try:
            if float(until) <= now_ms:
                out.append(name)
        except ValueError:
            out.append(name)
    return out


def listener_field(inst: str, key: str) -> str:
    """A listener's field in the route's hash (JSON: a key or a gateway id may hold a space)."""
    return orjson.dumps([inst, key]).decode()


def hears(keys: set[str], owner: str) -> bool:
    return ALL in keys or owner in keys


def counts_for(keys: set[str], counts: dict[str, int]) -> dict[str, int]:
    """The part of a gateway's per-key counts that a listener of ``keys`` may see."""
    return dict(counts) if ALL in keys else {k: counts.get(k, 0) for k in keys}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SocketBus:
    """This gateway's side of the cluster's ComfyUI websockets; see the module docstring."""

    def __init__(self, pool: aioredis.ConnectionPool, prefix: str, inst: str,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic):
        self.prefix, self.inst = prefix, inst
        self._pool = pool
        self._wall, self._clock = wall, clock
        self._wire = Wire(pool, CALL_SEC)  # publishes, in order, and the listeners' hash
        self._joined: Counter[tuple[str, str]] = Counter()  # (route, key or ALL) → sockets here
        self._seen: dict[str, tuple[float, dict[str, set[str]]]] = {}  # route → (read at, listeners)
        self._looking: dict[str, asyncio.Task[None]] = {}
        self._counts_here: dict[str, dict[str, int]] = {}  # route → the counts last published
        self._counts_there: dict[str, dict[str, tuple[float, dict[str, int]]]] = {}  # route → inst → (at, counts)
        self._subscribed: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: set by the ComfyUI adapter: a frame from another gateway, for this one's sockets
        self.on_frame: OnFrame = lambda route, owner, target, frame: None
        #: set by the ComfyUI adapter: another gateway's count for ``route`` changed
        self.on_counts: Callable[[str], None] = lambda route: None

    def _channel(self, inst: str) -> str:
        return f"{self.prefix}comfyws:to:{inst}"

    def _hash(self, route: str) -> str:
        return f"{self.prefix}comfyws:{route}"

    # --- the sockets on this gateway ------------------------------------------------------------
    async def join(self, route: str, key: str | None) -> None:
        """A socket for ``key``'s prompts (None: every key's) opens here: listen before it is told
        it is open, so that a prompt its client posts next through another gateway is heard."""
        field = (route, key if key is not None else ALL)
        self._joined[field] += 1
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._subscribed = loop.create_future()
            self._tasks = [loop.create_task(self._listen()), loop.create_task(self._beat())]
        try:
            async with asyncio.timeout(JOIN_SEC):
                assert self._subscribed is not None
                await asyncio.shield(self._subscribed)
                if self._joined[field] == 1:
                    name = listener_field(self.inst, field[1])
                    await self._wire.command("HSET", self._hash(route), name, self._until())
        except ERRORS as e:
            log.warning("cluster: /ws listener not shared (%s): this socket hears this gateway's prompts only", e)

    def leave(self, route: str, key: str | None) -> None:
        field = (route, key if key is not None else ALL)
        self._joined[field] -= 1
        if self._joined[field] <= 0:
            del self._joined[field]
            self._fire(self._wire.command("HDEL", self._hash(route), listener_field(self.inst, field[1])))

    def _until(self) -> int:
        return int((self._wall() + HOLD_SEC) * 1000)

    # --- who listens elsewhere ------------------------------------------------------------------
    async def look(self, route: str) -> None:
        """Read who listens for ``route`` now (a prompt is about to be sent: its first frames must
        reach a socket that opened a moment ago)."""
        try:
            async with asyncio.timeout(JOIN_SEC):  # a stalled Redis costs a prompt this much at most
                got = await self._wire.command("HGETALL", self._hash(route))
        except ERRORS as e:
            log.debug("cluster: /ws listeners of %s not read: %s", route, e)
            self._seen[route] = (self._clock(), self._seen.get(route, (0.0, {}))[1])
            return
        if isinstance(got, dict):  # RESP3 answers a map
            fields = {_s(k): _s(v) for k, v in got.items()}
        else:
            flat = [_s(v) for v in got] if isinstance(got, list) else []
            fields = dict(zip(flat[::2], flat[1::2], strict=False))
        now_ms = self._wall() * 1000
        self._seen[route] = (self._clock(), listeners(fields, self.inst, now_ms))
        gone = expired(fields, now_ms)
        if gone:
            self._fire(self._wire.command("HDEL", self._hash(route), *gone))

    def _there(self, route: str) -> dict[str, set[str]]:
        """Who listens for ``route`` elsewhere, as last read; read again in the background when old."""
        seen = self._seen.get(route)
        if (seen is None or self._clock() - seen[0] >= LOOK_SEC) and route not in self._looking:
            task = asyncio.get_running_loop().create_task(self.look(route))
            self._looking[route] = task
            task.add_done_callback(lambda _t: self._looking.pop(route, None))
        return seen[1] if seen is not None else {}

    def listened(self, route: str) -> bool:
        """Another gateway has a socket on ``route``."""
        return bool(self._there(route))

    # --- frames out -------------------------------------------------------------------------------
    def send(self, route: str, owner: str, target: str | None, frame: str | bytes) -> None:
        """A frame of ``owner``'s prompt, to every other gateway that listens for its key."""
        msg: bytes | None = None
        for inst, keys in self._there(route).items():
            if hears(keys, owner):
                if msg is None:
                    payload = frame.encode() if isinstance(frame, str) else frame
                    msg = encode(TEXT if isinstance(frame, str) else BINARY, [route, owner, target], payload)
                self._fire(self._wire.command("PUBLISH", self._channel(inst), msg))

    def counts(self, route: str, counts: dict[str, int]) -> None:
        """This gateway's prompts of ``route`` not yet ended, per key: to the gateways that listen."""
        if counts == self._counts_here.get(route, {}):
            return
        if counts:
            self._counts_here[route] = dict(counts)
        else:
            self._counts_here.pop(route, None)
        self._publish_counts(route, counts)

    def _publish_counts(self, route: str, counts: dict[str, int]) -> None:
        for inst, keys in self._there(route).items():
            mine = counts_for(keys, counts)
            self._fire(self._wire.command("PUBLISH", self._channel(inst),
                                          encode(STATUS, [route, self.inst], orjson.dumps(mine))))

    def elsewhere(self, route: str) -> Counter[str]:
        """The route's prompts not yet ended on the other gateways, per key (as they last said)."""
        out: Counter[str] = Counter()
        by_inst = self._counts_there.get(route, {})
        now = self._clock()
        for inst, (at, counts) in list(by_inst.items()):
            if now - at > COUNTS_TTL_SEC:
                del by_inst[inst]
                continue
            out.update(counts)
        return out

    @staticmethod
    def _fire(fut: asyncio.Future[Any]) -> None:
        fut.add_done_callback(_consumed)

    # --- frames in --------------------------------------------------------------------------------
    def _pushed(self, msg: list[Any]) -> None:
        got = decode(msg[2]) if len(msg) > 2 and isinstance(msg[2], bytes) else None
        if got is None:
            return
        kind, head, payload = got
        try:
            if kind == STATUS and len(head) == 2:
                counts = orjson.loads(payload)
                route, inst = str(head[0]), str(head[1])
                self._counts_there.setdefault(route, {})[inst] = (self._clock(), {
                    str(k): int(v) for k, v in counts.items() if isinstance(v, int) and v > 0})
                self.on_counts(route)
            elif kind in (TEXT, BINARY) and len(head) == 3:
                route, owner, target = str(head[0]), str(head[1]), head[2]
                frame: str | bytes = payload.decode() if kind == TEXT else payload
                self.on_frame(route, owner, target if isinstance(target, str) else None, frame)
        except Exception:  # one bad frame must not end the subscription
            log.exception("cluster: /ws frame from another gateway")

    def _now_subscribed(self) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_result(None)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await subscribed(self._pool, CALL_SEC, self._channel(self.inst), self._pushed,
                                 on_subscribed=self._now_subscribed)
            except ERRORS as e:
                if self._subscribed is not None and not self._subscribed.done():
                    self._subscribed.set_exception(e)
                    self._subscribed.exception()
            await asyncio.sleep(BEAT_SEC)
            if self._subscribed is not None and self._subscribed.done() and self._subscribed.exception() is not None:
                self._subscribed = loop.create_future()  # the next socket waits for this attempt

    async def _beat(self) -> None:
        """Keep this gateway's listener fields alive, and its non-zero counts heard."""
        while True:
            await asyncio.sleep(BEAT_SEC)
            until = self._until()
            for route, key in list(self._joined):
                self._fire(self._wire.command("HSET", self._hash(route), listener_field(self.inst, key), until))
            for route, counts in list(self._counts_here.items()):
                self._publish_counts(route, counts)

    async def stop(self) -> None:
        """Leave: the other gateways stop publishing here at once."""
        tasks = [*self._tasks, *self._looking.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._joined:
            with contextlib.suppress(*ERRORS):
                async with asyncio.timeout(1.0):
                    await asyncio.gather(*(self._wire.command("HDEL", self._hash(r), listener_field(self.inst, k))
                                           for r, k in self._joined))
        self._wire.close()


def _consumed(fut: asyncio.Future[Any]) -> None:
    """A publish's answer: lost with Redis, which the next look and beat notice."""
    if not fut.cancelled():
        fut.exception()
