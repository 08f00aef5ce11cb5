"""ComfyUI's control endpoints behind the gateway: answered at once, and only for your own prompts.

``POST /interrupt``, ``POST /queue`` (``delete``, ``clear``) and ``POST /api/jobs/{id}/cancel``
are not GPU work: queued, they would arrive after the prompt they mean to stop. And on a shared
node they act on everybody's prompts (``/interrupt {}`` stops whatever runs, ``clear`` empties
the whole queue). Behind the gateway they act only on prompts that the same key submitted
through it: the route keeps a bounded record of prompt_id → (key, node), written when a node
accepts a prompt. A request about someone else's prompt gets ComfyUI's own answer for a prompt
that is not there (200, nothing done), so prompt ids of other keys cannot be probed.

The per-runtime ComfyUI state (this record and the monitor sockets) lives here too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.comfy_monitor import Monitors, NodeMonitor
from kilolined.adapters.comfy_node import NodeAPI, NodeError, all_ids, node_api
from kilolined.core.errors import error_response
from kilolined.ops.runtime import Runtime
from kilolined.wire import expect

log = logging.getLogger("kilolined")

OWNERS_MAX = 10_000  # prompts remembered per route (the oldest are forgotten first)
WS_MAX_MSG = 64 * 1024 * 1024
STATE_KEY = "comfyui"


class PromptOwners:
    """prompt_id → (subject, node) of one route, bounded, most recent last."""

    def __init__(self, cap: int = OWNERS_MAX):
        self.cap = cap
        self._by_id: OrderedDict[str, tuple[str, str]] = OrderedDict()

    def add(self, prompt_id: str, subject: str, node: str) -> None:
        self._by_id[prompt_id] = (subject, node)
        self._by_id.move_to_end(prompt_id)
        while len(self._by_id) > self.cap:
            self._by_id.popitem(last=False)

    def node_of(self, prompt_id: Any, subject: str) -> str | None:
        """The node of ``prompt_id`` if ``subject`` submitted it, else None."""
        got = self._by_id.get(prompt_id) if isinstance(prompt_id, str) else None
        return got[1] if got is not None and got[0] == subject else None

    def mine(self, subject: str) -> dict[str, str]:
        return {pid: node for pid, (who, node) in self._by_id.items() if who == subject}


class NodeActivity:
    """When the gateway last heard from each ComfyUI node (loop time): the stall watch's clock
    (docs/CONFIG.md "Slow nodes"). Any frame from the node counts — on a job's prompt socket, on
    the node's monitor socket, on a client's /ws relayed through the gateway — so a prompt that
    waits in the node's own queue behind another one is not stalled while that one moves.

    A node's entry lives from its first watcher to its last (a prompt of ours running there):
    the map never holds more nodes than have prompts in flight, whatever ad-hoc targets or
    removed nodes came and went. Pure bookkeeping: the caller passes the time."""

    __slots__ = ("_last", "_watchers")

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._watchers: dict[str, int] = {}

    def watch(self, node: str, now: float) -> None:
        """A prompt of ours runs on ``node`` from ``now``: the node is given stall_sec from then."""
        self._watchers[node] = self._watchers.get(node, 0) + 1
        self._last[node] = now

    def unwatch(self, node: str) -> None:
        left = self._watchers.get(node, 0) - 1
        if left > 0:
            self._watchers[node] = left
        else:
            self._watchers.pop(node, None)
            self._last.pop(node, None)

    def seen(self, node: str, now: float) -> None:
        """A frame came from ``node`` (nothing is kept for a node nobody watches)."""
        if node in self._last:
            self._last[node] = now

    def last(self, node: str) -> float | None:
        return self._last.get(node)

    def __len__(self) -> int:
        return len(self._last)


class RelayWatch:
    """A client's /ws relayed from ``node`` (wsproxy.proxy_websocket): every frame from the node
    is a sign of its life, and while it is open the client id it listens under (its
    ``clientId``, else the ``sid`` of the node's first ``status``) has a sync prompt's progress
    pass through the gateway, so that prompt can be watched for a stall."""

    __slots__ = ("_asked", "_loop", "_open", "client_id", "node", "state")

    def __init__(self, state: ComfyState, node: str, client_id: str | None):
        self.state, self.node = state, node
        self.client_id = client_id or None
        self._asked = self.client_id is not None  # ComfyUI names the socket in its first frame otherwise
        self._open = False
        self._loop = asyncio.get_running_loop()

    def opened(self) -> None:
        self._open = True
        if self.client_id is not None:
            self.state.relay_opened(self.node, self.client_id)

    def frame(self, data: str | bytes) -> None:
        self.state.activity.seen(self.node, self._loop.time())
        if not self._asked and isinstance(data, str):
            self._asked = True
            sid = _sid(data)
            if sid is not None:
                self.client_id = sid
                if self._open:
                    self.state.relay_opened(self.node, sid)

    def closed(self) -> None:
        if self._open and self.client_id is not None:
            self.state.relay_closed(self.node, self.client_id)
        self._open = False


def _sid(raw: str) -> str | None:
    """The client id ComfyUI gave a socket without one: its first frame's ``status.sid``."""
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    data = msg.get("data") if isinstance(msg, dict) and msg.get("type") == "status" else None
    sid = data.get("sid") if isinstance(data, dict) else None
    return sid if isinstance(sid, str) and sid else None


class ComfyState:
    """What the ComfyUI adapter keeps across requests of one runtime."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.monitors = Monitors(rt.spawn)
        self.routes: dict[str, PromptOwners] = {}
        self.activity = NodeActivity()
        #: (node, client id) → the client's sockets relayed from that node now
        self.relays: dict[tuple[str, str], int] = {}

    def relay_opened(self, node: str, client_id: str) -> None:
        self.relays[node, client_id] = self.relays.get((node, client_id), 0) + 1

    def relay_closed(self, node: str, client_id: str) -> None:
        left = self.relays.get((node, client_id), 0) - 1
        if left > 0:
            self.relays[node, client_id] = left
        else:
            self.relays.pop((node, client_id), None)

    def relayed(self, node: str, client_id: str) -> bool:
        """A socket listening as ``client_id`` is relayed through the gateway from ``node`` now."""
        return (node, client_id) in self.relays

    def owners(self, route: str) -> PromptOwners:
        got = self.routes.get(route)
        if got is None:
            got = self.routes[route] = PromptOwners()
        return got

    def monitor(self, node: str) -> NodeMonitor:
        rt = self.rt
        ns = rt.scheduler.nodes[node]

        def alive() -> bool:
            # The same node object: a new URL is a new node, a removed one is retired.
            return rt.started and rt.scheduler.nodes.get(node) is ns and not ns.retired

        async def connect(client_id: str) -> aiohttp.ClientWebSocketResponse:
            return await rt.session(node).ws_connect(
                f"{ns.cfg.url}/ws?clientId={client_id}", headers=ns.cfg.headers, autoping=True, heartbeat=15,
                max_msg_size=WS_MAX_MSG, timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=1.0))

        def heard() -> None:
            self.activity.seen(node, asyncio.get_running_loop().time())

        return self.monitors.get(node, lambda: NodeMonitor(node, connect, alive, heard))


def comfy_state(rt: Runtime) -> ComfyState:
    st = rt.adapter_state.get(STATE_KEY)
    if not isinstance(st, ComfyState):
        st = rt.adapter_state[STATE_KEY] = ComfyState(rt)
    return st


# --- the control endpoints ----------------------------------------------------------------------

def action_of(method: str, path: str) -> str | None:
    if method != "POST":
        return None
    p = path.removeprefix("/api") if path.startswith("/api/") else path
    if p in ("/interrupt", "/queue"):
        return p[1:]
    if path == "/api/jobs/cancel":
        return "cancel_many"
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "api", "jobs"] and parts[4] == "cancel" and parts[3]:
        return "cancel"
    return None


async def control(rt: Runtime, request: web.Request, route: str, path: str, subject: str,
                  request_id: str) -> web.StreamResponse | None:
    """The answer to a control request, or None when ``path`` is not one."""
    action = action_of(request.method, path)
    if action is None:
        return None
    if request.can_read_body:
        expect.let_body_come(request)
        raw = await request.read()
    else:
        raw = b""
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        body = None
    body = body if isinstance(body, dict) else {}
    owners = comfy_state(rt).owners(route)
    headers = {"X-Request-Id": request_id}
    try:
        if action == "interrupt":
            await _interrupt(rt, owners, subject, body.get("prompt_id"), path, request_id)
        elif action == "queue":
            await _queue(rt, owners, subject, body, path, request_id)
        elif action == "cancel":
            jid = path.split("/")[3]
            node = owners.node_of(jid, subject)
            if node is None or node not in rt.scheduler.nodes:
                return web.json_response({"cancelled": False}, headers=headers)
            status, answer, ctype = await node_api(rt, node, request_id).post(path, {})
            return web.Response(status=status, body=answer, headers={**headers, "Content-Type": ctype})
        else:
            ids = body.get("job_ids")
            if not isinstance(ids, list):
                return web.json_response({"error": "job_ids must be a list"}, status=400, headers=headers)
            cancelled = False
            for node, pids in _by_node(rt, owners, subject, ids).items():
                status, answer, _ = await node_api(rt, node, request_id).post(path, {"job_ids": pids})
                cancelled |= status == 200 and b"true" in answer
            return web.json_response({"cancelled": cancelled}, headers=headers)
    except NodeError as e:
        return error_response(502, "upstream_error", e.reason, request_id=request_id)
    return web.Response(status=200, headers=headers)


def _by_node(rt: Runtime, owners: PromptOwners, subject: str, ids: list[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pid in ids:
        node = owners.node_of(pid, subject)
        if node is not None and node in rt.scheduler.nodes:
            out.setdefault(node, []).append(pid)
    return out


async def _queues(rt: Runtime, owners: PromptOwners, subject: str,
                  request_id: str) -> list[tuple[NodeAPI, dict[str, Any], set[str]]]:
    """(node, its /queue, the subject's prompt ids on it) for every node holding one of them."""
    nodes: dict[str, set[str]] = {}
    for pid, node in owners.mine(subject).items():
        if node in rt.scheduler.nodes:
            nodes.setdefault(node, set()).add(pid)
    apis = {n: node_api(rt, n, request_id) for n in nodes}
    got = await asyncio.gather(*(apis[n].get_json("/queue") for n in nodes), return_exceptions=True)
    out = []
    for n, q in zip(nodes, got, strict=True):
        if isinstance(q, dict):
            out.append((apis[n], q, nodes[n]))
        elif isinstance(q, BaseException) and not isinstance(q, NodeError):
            raise q
    return out


async def _interrupt(rt: Runtime, owners: PromptOwners, subject: str, prompt_id: Any, path: str,
                     request_id: str) -> None:
    if prompt_id:
        node = owners.node_of(prompt_id, subject)
        if node is not None and node in rt.scheduler.nodes:
            await node_api(rt, node, request_id).post(path, {"prompt_id": prompt_id})
        return
    # No id: ComfyUI would stop whatever runs; here, the key's own running prompt(s) only.
    for api, queue, mine in await _queues(rt, owners, subject, request_id):
        for pid in all_ids(queue.get("queue_running")):
            if pid in mine:
                await api.post(path, {"prompt_id": pid})


async def _queue(rt: Runtime, owners: PromptOwners, subject: str, body: dict[str, Any], path: str,
                 request_id: str) -> None:
    delete = body.get("delete")
    if isinstance(delete, list):
        for node, pids in _by_node(rt, owners, subject, delete).items():
            await node_api(rt, node, request_id).post(path, {"delete": pids})
    if body.get("clear"):
        for api, queue, mine in await _queues(rt, owners, subject, request_id):
            pending = [pid for pid in all_ids(queue.get("queue_pending")) if pid in mine]
            if pending:
                await api.post(path, {"delete": pending})

