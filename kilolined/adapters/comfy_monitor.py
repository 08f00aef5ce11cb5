"""One websocket per ComfyUI node that tells waiting prompts when the node's queue changed.

ComfyUI broadcasts ``status`` to every socket on every queue change (a prompt queued, started,
ended), and writes a prompt's history before the ``status`` of its end. So one socket per node,
under a client id of its own, learns within milliseconds that some prompt ended, whoever
submitted it; a sync hold then reads ``/history`` once instead of polling every quarter second.

The monitor is started on first use, reconnects with a backoff while its node is down, and ends
by itself once its node is removed or changes URL (``alive``) or with the runtime (its task is
spawned there, and a stop cancels it). While it is not connected, waiters fall back to polling.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

log = logging.getLogger("kilolined")

CHECK_SEC = 1.0  # how soon a removed node's socket closes
BACKOFF_MIN_SEC = 0.2
BACKOFF_MAX_SEC = 5.0
MAX_MSG = 64 * 1024 * 1024  # previews are broadcast too
# Frames that may mean a prompt ended (or the queue moved): wake every waiter to look.
WAKE = frozenset({"status", "execution_success", "execution_error", "execution_interrupted"})

Connect = Callable[[str], Awaitable[aiohttp.ClientWebSocketResponse]]
OnFrame = Callable[[aiohttp.WSMessage], Awaitable[None]]
# The monitor's first frame: ComfyUI then sends previews with their prompt id (binary type 4).
FEATURES = orjson.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": True}}).decode()


def wakes(raw: str) -> bool:
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(msg, dict):
        return False
    kind, data = msg.get("type"), msg.get("data")
    if kind in WAKE:
        return True
    return kind == "executing" and isinstance(data, dict) and "node" in data and data["node"] is None


class NodeMonitor:
    """``v = mon.version; <look at the node>; await mon.changed(v, fallback)`` — no change is lost
    between the look and the wait, because the version is read first."""

    __slots__ = ("_alive", "_connect", "_heard", "_on_frame", "_waiters", "client_id", "connected", "name", "task",
                 "tried", "version")

    def __init__(self, name: str, connect: Connect, alive: Callable[[], bool],
                 heard: Callable[[], None] | None = None, client_id: str | None = None,
                 on_frame: OnFrame | None = None):
        self.name = name
        self._connect = connect
        self._alive = alive
        self._heard = heard  # told of every frame: the node is alive (the stall watch's clock)
        #: the gateway's prompts are sent to the node under this id: their events come here too
        self.client_id = client_id or f"kilolined-monitor-{uuid.uuid4().hex}"
        self._on_frame = on_frame  # hears every frame first (comfy_hub.py: the clients' sockets)
        self.version = 0
        self.connected = False
        self.tried = False  # its first connection attempt has ended (in a socket or a failure)
        self._waiters: set[asyncio.Future[None]] = set()
        self.task: asyncio.Task[Any] | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def changed(self, since: int, timeout: float) -> bool:
        """Wait until something happened after ``since`` (True), or ``timeout`` passed (False)."""
        if self.version != since:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
            return True
        except TimeoutError:
            return self.version != since
        finally:
            self._waiters.discard(fut)

    def alive(self) -> bool:
        return self._alive()

    def _bump(self) -> None:
        self.version += 1
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    async def run(self) -> None:
        backoff = BACKOFF_MIN_SEC
        while self._alive():
            try:
                ws = await self._connect(self.client_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # refused, handshake, timeout: the node is down or restarting
                log.debug("[%s] monitor socket: %s", self.name, type(e).__name__)
                if not self.tried:
                    self.tried = True
                    self._bump()  # whoever waits for the first attempt stops waiting
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_SEC)
                continue
            backoff = BACKOFF_MIN_SEC
            try:
                await ws.send_str(FEATURES)
            except (ConnectionError, RuntimeError):
                await ws.close()
                continue
            self.connected = self.tried = True
            self._bump()  # whatever happened while we were away: look again
            try:
                await self._follow(ws)
            finally:
                self.connected = False
                self._bump()  # waiters go back to polling
                await ws.close()

    async def _follow(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while self._alive():
            try:
                msg = await ws.receive(timeout=CHECK_SEC)
            except TimeoutError:
                continue
            if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                return  # closed or broken: reconnect
            if self._heard is not None:
                self._heard()
            if self._on_frame is not None:
                try:
                    await self._on_frame(msg)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad frame must not end the node's monitor
                    log.exception("[%s] monitor frame", self.name)
            if msg.type == aiohttp.WSMsgType.TEXT and wakes(msg.data):
                self._bump()


class Monitors:
    """The monitors of one runtime, by node name (made and started on first use)."""

    def __init__(self, spawn: Callable[[Any], asyncio.Task[Any]]):
        self._spawn = spawn
        self.by_node: dict[str, NodeMonitor] = {}

    def get(self, name: str, make: Callable[[], NodeMonitor]) -> NodeMonitor:
        mon = self.by_node.get(name)
        if mon is None or not mon.running or not mon.alive():
            mon = self.by_node[name] = make()
            mon.task = self._spawn(mon.run())
            made = mon
            mon.task.add_done_callback(lambda _t: self._gone(made))
        return mon

    def _gone(self, mon: NodeMonitor) -> None:
        if self.by_node.get(mon.name) is mon:
            del self.by_node[mon.name]
