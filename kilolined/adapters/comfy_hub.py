"""One websocket for a ComfyUI route: ``{path}/ws?clientId=X`` is a socket to the gateway, fed by
every node of the route.

The gateway sends every prompt to its node with its own client id (the same on every node), so
the node's monitor socket (comfy_monitor.py), which listens under that id, receives every event
of every prompt the gateway sent there: ``execution_*``, ``executing``, ``progress``,
``progress_state``, ``executed`` and the binary previews. The hub hands each event to the client
sockets that the prompt's sender would have heard it on in ComfyUI (the sender's key — or
everyone on a ``comfy.shared`` route or for the admin key — and the ``client_id`` it sent),
under the prompt ids it was given. ``status`` is the route's: the viewer's own prompts not yet
ended, whatever node holds them.

A node may start a prompt before its answer to the POST reached the gateway: its frames about a
prompt the record does not know yet are kept (a few per node) until the record learns it
(``claim``), then handed on in order.

In cluster mode the gateway that runs a prompt also hands its frames to the other gateways whose
sockets listen for its key (cluster/comfyws.py), and hands their frames to its own sockets: a
browser whose socket is on one gateway hears the prompts it posted through another. ``status``
then counts the route's prompts on every gateway.

A prompt whose node is lost and that runs nowhere else is told to its sockets as ComfyUI
tells a prompt that failed (``lost``): an ``execution_error``, the route's ``status``, then
``executing`` with node null, so the web UI stops showing it running.

Previews: the monitor asks for ComfyUI's previews with metadata (binary type 4, which name their
prompt), so each goes to the right client; a client that did not ask for them (no
``feature_flags``) gets the plain form (type 1) that ComfyUI would have sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.comfy_record import EVERYONE, PromptOwners, Viewer, without_traceback
from kilolined.cluster.comfyws import SocketBus

log = logging.getLogger("kilolined")

UNCLAIMED_MAX = 64  # per node: text frames about a prompt before the record knew it (its POST's answer was in flight)
OUTBOX_MAX = 1024  # frames waiting for a slow client; past that it is closed (it reconnects)
OUTBOX_MAX_BYTES = 16 * 1024 * 1024  # and bytes (previews are images)
CLIENT_MAX_MSG = 4 * 1024 * 1024
HEARTBEAT_SEC = 30.0
PREVIEW, PREVIEW_WITH_METADATA = 1, 4
FORMATS = {"image/jpeg": 1, "image/png": 2}  # type-1 previews: uint32 format, then the image
# Events ComfyUI sends about one prompt: they go where the prompt's sender listens.
ENDED = frozenset({"execution_success", "execution_error", "execution_interrupted"})


@dataclass(eq=False)
class Client:
    ws: web.WebSocketResponse
    route: str
    client_id: str
    viewer: Viewer
    metadata: bool = False  # asked for previews with metadata (binary type 4)
    outbox: asyncio.Queue[str | bytes | None] = field(default_factory=lambda: asyncio.Queue(OUTBOX_MAX))
    queued: int = 0  # bytes in the outbox
    closing: bool = False

    def send(self, frame: str | bytes) -> None:
        if self.closing:
            return
        self.queued += len(frame)
        if self.queued <= OUTBOX_MAX_BYTES:
            with contextlib.suppress(asyncio.QueueFull):
                self.outbox.put_nowait(frame)
                return
        log.info("a /ws client fell too far behind (%d frames, %d bytes): closed", self.outbox.qsize(), self.queued)
        self.closing = True
        while not self.outbox.empty():  # nothing more for it: the writer closes it next
            self.outbox.get_nowait()
        self.queued = 0
        self.outbox.put_nowait(None)

    def hears(self, owner: str, target: str | None) -> bool:
        """Would ComfyUI send this client an event of a prompt by ``owner`` sent to ``target``?"""
        if self.viewer.subject is not None and self.viewer.subject != owner:
            return False
        return target is None or target == self.client_id


def ws_event(raw: str) -> tuple[str, dict[str, Any]] | None:
    """A ComfyUI /ws text message's ``type`` and ``data``; None for anything else."""
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) or not isinstance(msg.get("data"), dict):
        return None
    return msg["type"], msg["data"]


def preview_prompt(frame: bytes) -> str | None:
    """The prompt id in a type-4 preview's metadata, if any."""
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != PREVIEW_WITH_METADATA:
        return None
    size = struct.unpack(">I", frame[4:8])[0]
    try:
        meta = orjson.loads(frame[8:8 + size])
    except orjson.JSONDecodeError:
        return None
    pid = meta.get("prompt_id") if isinstance(meta, dict) else None
    return pid if isinstance(pid, str) else None


def plain_preview(frame: bytes) -> bytes | None:
    """A type-4 preview as ComfyUI sends it to a client without metadata (type 1 + format)."""
    size = struct.unpack(">I", frame[4:8])[0]
    try:
        meta = orjson.loads(frame[8:8 + size])
    except orjson.JSONDecodeError:
        return None
    mime = meta.get("image_type") if isinstance(meta, dict) else None
    fmt = FORMATS.get(mime, 1) if isinstance(mime, str) else 1
    return struct.pack(">II", PREVIEW, fmt) + frame[8 + size:]


#: (route, node, owner, an ``executed`` event's data) → the data with its files under the route's
#: names (comfy_store.py): the name the web UI asks ``/view`` for at once
Executed = Callable[[str, str, str, dict[str, Any]], dict[str, Any]]


def _clean(kind: str, data: dict[str, Any], raw: str, executed: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """The frame a client gets: an execution_error without the node's traceback, an ``executed``
    event naming its files as the route does."""
    if kind == "execution_error" and "traceback" in data:
        return orjson.dumps({"type": kind, "data": without_traceback(data)}).decode()
    if kind == "executed":
        return orjson.dumps({"type": kind, "data": executed(data)}).decode()
    return raw


def lost_error(prompt_id: str, node_id: str | None, graph: Any, message: str, now_ms: int) -> dict[str, Any]:
    """The ``execution_error`` ComfyUI sends for a prompt that failed at ``node_id`` (execution.py's
    shape, without the traceback the gateway never passes on), for a prompt whose node was lost."""
    spec = graph.get(node_id) if isinstance(graph, dict) and node_id is not None else None
    kind = spec.get("class_type") if isinstance(spec, dict) else None
    return {"prompt_id": prompt_id, "node_id": node_id, "node_type": kind if isinstance(kind, str) else None,
            "executed": [], "exception_message": message, "exception_type": "NodeLost",
            "current_inputs": {}, "current_outputs": [], "timestamp": now_ms}


def refusal_error(prompt_id: str, graph: Any, answer: Any, message: str, now_ms: int) -> dict[str, Any]:
    """The ``execution_error`` of a prompt no node ran (its node refused it: ``answer``, the node's
    400 body, names the node its ``node_errors`` or ``extra_info`` blame; or it never reached
    one), in execution.py's shape; ``exception_type`` is the node's error type when it gave one."""
    err = answer.get("error") if isinstance(answer, dict) else None
    node_errors = answer.get("node_errors") if isinstance(answer, dict) else None
    node_id: str | None = next(iter(node_errors), None) if isinstance(node_errors, dict) else None
    info = err.get("extra_info") if isinstance(err, dict) else None
    if node_id is None and isinstance(info, dict) and isinstance(info.get("node_id"), str):
        node_id = info["node_id"]
    data = lost_error(prompt_id, node_id, graph, message, now_ms)
    kind = err.get("type") if isinstance(err, dict) else None
    data["exception_type"] = kind if isinstance(kind, str) and kind else "PromptNotRun"
    named = node_errors.get(node_id) if isinstance(node_errors, dict) and node_id is not None else None
    if data["node_type"] is None and isinstance(named, dict) and isinstance(named.get("class_type"), str):
        data["node_type"] = named["class_type"]
    if data["node_type"] is None and isinstance(info, dict) and isinstance(info.get("class_type"), str):
        data["node_type"] = info["class_type"]
    return data


def text_frame(kind: str, data: dict[str, Any]) -> str:
    return orjson.dumps({"type": kind, "data": data}).decode()


def status_frame(remaining: int, sid: str | None = None) -> str:
    data: dict[str, Any] = {"status": {"exec_info": {"queue_remaining": remaining}}}
    if sid is not None:
        data["sid"] = sid
    return orjson.dumps({"type": "status", "data": data}).decode()


class Hub:
    """The client sockets of one runtime's ComfyUI routes, and where each node's frames go."""

    def __init__(self, owners: Callable[[str], PromptOwners], routes_of: Callable[[str], list[str]],
                 executed: Executed, bus: SocketBus | None = None,
                 queued: Callable[[str], Counter[str]] | None = None):
        self._owners = owners  # route → its record
        self._queued = queued  # route → its prompts in the gateway's own queue, per key
        self._routes_of = routes_of  # node → the routes it serves
        self._executed = executed
        self.bus = bus  # cluster mode: the other gateways' sockets, and their frames for ours
        self.clients: dict[str, set[Client]] = {}  # route → its sockets
        self.current: dict[str, str] = {}  # node → the prompt it runs now (for frames that name none)
        self.executing: dict[str, str] = {}  # node → its last `executing` frame of a prompt still running
        #: node → (prompt id, kind, data, raw) of frames that named a prompt the record did not know yet
        self.unclaimed: dict[str, deque[tuple[str, str, dict[str, Any], str]]] = {}

    # --- the client side -------------------------------------------------------------------------
    def _waiting(self, route: str) -> Counter[str]:
        """The route's prompts not yet ended on this gateway, per key: on a node, or in its queue."""
        waiting = Counter(p.subject for p in self._owners(route).waiting(EVERYONE).values())
        if self._queued is not None:
            waiting.update(self._queued(route))
        return waiting

    def remaining(self, route: str, viewer: Viewer) -> int:
        waiting = self._waiting(route)
        here = waiting.total() if viewer.subject is None else waiting[viewer.subject]
        if self.bus is None:
            return here
        there = self.bus.elsewhere(route)
        return here + (sum(there.values()) if viewer.subject is None else there[viewer.subject])

    async def serve(self, request: web.Request, route: str, viewer: Viewer,
                    features: Callable[[], Any], headers: dict[str, str]) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=True, heartbeat=HEARTBEAT_SEC, max_msg_size=CLIENT_MAX_MSG)
        for k, v in headers.items():
            ws.headers[k] = v
        bus = self.bus
        if bus is not None:
            await bus.join(route, viewer.subject)  # before the handshake ends: a prompt posted next is heard
        try:
            return await self._serve(request, ws, route, viewer, features)
        finally:
            if bus is not None:
                bus.leave(route, viewer.subject)

    async def _serve(self, request: web.Request, ws: web.WebSocketResponse, route: str, viewer: Viewer,
                     features: Callable[[], Any]) -> web.WebSocketResponse:
        await ws.prepare(request)
        client = Client(ws, route, request.query.get("clientId") or uuid.uuid4().hex, viewer)
        client.send(status_frame(self.remaining(route, viewer), client.client_id))
        self._now_executing(client)
        self.clients.setdefault(route, set()).add(client)
        writer = asyncio.ensure_future(self._write(client))
        try:
            first = True
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                got = ws_event(msg.data) if first else None
                first = False
                if got is not None and got[0] == "feature_flags":
                    # As ComfyUI: only a first frame negotiates; the answer is the node's own flags.
                    client.metadata = got[1].get("supports_preview_metadata") is True
                    client.send(orjson.dumps({"type": "feature_flags", "data": await features()}).decode())
        finally:
            group = self.clients.get(route)
            if group is not None:
                group.discard(client)
                if not group:
                    del self.clients[route]
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        return ws

    def _now_executing(self, client: Client) -> None:
        """As ComfyUI tells a socket that (re)connects under the id of the running prompt which
        node runs (a page reloaded mid-render shows it again)."""
        for node, raw in self.executing.items():
            found = self.find(node, self.current.get(node))
            if found is not None and found[0] == client.route and client.hears(found[1], found[2]):
                client.send(raw)

    @staticmethod
    async def _write(client: Client) -> None:
        ws = client.ws
        while True:
            frame = await client.outbox.get()
            client.queued -= len(frame) if frame is not None else 0
            try:
                if frame is None:
                    await ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION, message=b"too slow")
                    return
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
            except (ConnectionError, RuntimeError):
                return

    # --- the node side ---------------------------------------------------------------------------
    def status(self, node: str) -> None:
        """The node's queue moved: every client of its routes hears its own count."""
        for route in self._routes_of(node):
            self.status_of(route)

    def status_of(self, route: str) -> None:
        """Every client of ``route`` hears its own count (one pass over the route's record, not
        one per client); in cluster mode the other gateways hear this one's, and theirs count."""
        clients = self.clients.get(route)
        bus = self.bus
        if not clients and (bus is None or not bus.listened(route)):
            return
        waiting = self._waiting(route)
        if bus is not None:
            bus.counts(route, dict(waiting))
            waiting.update(bus.elsewhere(route))
        total = sum(waiting.values())
        for client in clients or ():
            subject = client.viewer.subject
            client.send(status_frame(total if subject is None else waiting[subject]))

    def routes_of_prompt(self, node: str, prompt_id: str) -> list[str]:
        return [r for r in self._routes_of(node)
                if (p := self._owners(r).get(prompt_id)) is not None and p.node == node]

    def find(self, node: str, prompt_id: str | None) -> tuple[str, str, str | None] | None:
        """(route, owner, target) of a prompt the gateway sent to ``node``."""
        if prompt_id is None:
            return None
        for route in self._routes_of(node):
            p = self._owners(route).get(prompt_id)
            if p is not None and p.node == node:
                return route, p.subject, p.target()
        return None

    def event(self, node: str, kind: str, data: dict[str, Any], raw: str) -> str | None:
        """Hand one text frame of ``node`` on; returns the prompt id it is about, if one of ours."""
        if kind == "status":
            self.status(node)
            return None
        if kind == "feature_flags":
            return None  # the node's answer to the monitor
        pid = data.get("prompt_id")
        if not isinstance(pid, str):
            pid = self.current.get(node)  # `executing` on reconnect, custom nodes' events
        self._track(node, kind, data, pid, raw)
        found = self.find(node, pid)
        if found is None:
            if isinstance(data.get("prompt_id"), str):
                # A node may run a prompt before its POST's answer reached the gateway: kept until
                # the record knows the prompt (``claim``), pushed out by newer ones.
                held = self.unclaimed.setdefault(node, deque(maxlen=UNCLAIMED_MAX))
                held.append((data["prompt_id"], kind, data, raw))
            return None
        self._deliver(found, self._clean(node, found, kind, data, raw))
        return pid

    def _track(self, node: str, kind: str, data: dict[str, Any], pid: str | None, raw: str) -> None:
        """Which prompt ``node`` runs now, and its last ``executing`` frame of it (a socket that
        opens mid-render is told; a prompt lost there names where it was)."""
        if kind == "execution_start" and isinstance(pid, str):
            self.current[node] = pid
        ended = kind in ENDED or (kind == "executing" and data.get("node", "") is None)
        if ended and self.current.get(node) == pid:
            del self.current[node]
            self.executing.pop(node, None)
        elif kind == "executing" and isinstance(pid, str) and self.current.get(node) == pid:
            self.executing[node] = raw

    def claim(self, node: str, prompt_id: str) -> None:
        """The record has just learnt that ``prompt_id`` runs on ``node``: what the node already
        said of it goes to its listeners now, in order."""
        frames = self.unclaimed.get(node)
        found = self.find(node, prompt_id) if frames else None
        if frames is None or found is None:
            return
        rest: deque[tuple[str, str, dict[str, Any], str]] = deque(maxlen=UNCLAIMED_MAX)
        for frame in frames:
            pid, kind, data, raw = frame
            if pid == prompt_id:
                self._deliver(found, self._clean(node, found, kind, data, raw))
            else:
                rest.append(frame)
        self.unclaimed[node] = rest

    def relay(self, node: str, prompt_id: str, msg: aiohttp.WSMessage) -> None:
        """A frame of an sse/async job's own socket, where every event is about its one prompt."""
        found = self.find(node, prompt_id)
        if found is None:
            return
        if msg.type == aiohttp.WSMsgType.BINARY:
            self._preview_to(found, msg.data)
            return
        got = ws_event(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else None
        if got is None or got[0] in ("status", "feature_flags") or got[1].get("prompt_id", prompt_id) != prompt_id:
            return
        self._track(node, got[0], got[1], prompt_id, msg.data)
        self._deliver(found, self._clean(node, found, got[0], got[1], msg.data))

    def lost(self, node: str, prompt_id: str, graph: Any, message: str, now_ms: int) -> None:
        """``prompt_id``'s node was lost and the prompt runs nowhere now (its record says it
        ended): its sockets hear what ComfyUI sends of a prompt that failed — the error at the
        node it was running, the queue's new count, and the end of its execution."""
        running: str | None = None
        if self.current.get(node) == prompt_id:
            got = ws_event(self.executing.get(node, ""))
            at = got[1].get("node") if got is not None else None
            running = at if isinstance(at, str) else None
            del self.current[node]
            self.executing.pop(node, None)
        found = self.find(node, prompt_id)
        if found is not None:
            self._failed(found, lost_error(prompt_id, running, graph, message, now_ms))

    def refused(self, route: str, prompt_id: str, error: dict[str, Any]) -> None:
        """``prompt_id`` (in the route's record, ended) was answered by the gateway, then no node
        ran it: its sockets hear it end as ComfyUI ends a prompt that failed."""
        p = self._owners(route).get(prompt_id)
        if p is not None:
            self._failed((route, p.subject, p.target()), error)

    def _failed(self, found: tuple[str, str, str | None], error: dict[str, Any]) -> None:
        """What ComfyUI sends of a prompt that failed: the error, the queue's new count, then the
        end of its execution (the web UI stops showing it running)."""
        self._deliver(found, text_frame("execution_error", error))
        self.status_of(found[0])
        self._deliver(found, text_frame("executing", {"node": None, "prompt_id": error["prompt_id"]}))

    def remote(self, route: str, owner: str, target: str | None, frame: str | bytes) -> None:
        """A frame of a prompt another gateway runs (cluster mode), for this gateway's sockets."""
        if isinstance(frame, bytes):
            self._preview_here((route, owner, target), frame)
        else:
            self._deliver_here((route, owner, target), frame)

    def preview(self, node: str, frame: bytes) -> None:
        found = self.find(node, preview_prompt(frame) or self.current.get(node))
        if found is not None:
            self._preview_to(found, frame)

    def _preview_to(self, found: tuple[str, str, str | None], frame: bytes) -> None:
        self._preview_here(found, frame)
        if self.bus is not None:
            self.bus.send(*found, frame)

    def _preview_here(self, found: tuple[str, str, str | None], frame: bytes) -> None:
        route, owner, target = found
        plain: bytes | None = None
        for client in self.clients.get(route, ()):
            if not client.hears(owner, target):
                continue
            if client.metadata or struct.unpack(">I", frame[:4])[0] != PREVIEW_WITH_METADATA:
                client.send(frame)
            else:
                plain = plain if plain is not None else plain_preview(frame)
                if plain is not None:
                    client.send(plain)

    def _clean(self, node: str, found: tuple[str, str, str | None], kind: str, data: dict[str, Any], raw: str) -> str:
        route, owner, _ = found
        return _clean(kind, data, raw, lambda d: self._executed(route, node, owner, d))

    def _deliver(self, found: tuple[str, str, str | None], raw: str) -> None:
        self._deliver_here(found, raw)
        if self.bus is not None:
            self.bus.send(*found, raw)

    def _deliver_here(self, found: tuple[str, str, str | None], raw: str) -> None:
        route, owner, target = found
        for client in self.clients.get(route, ()):
            if client.hears(owner, target):
                client.send(raw)
