"""ComfyUI's control endpoints behind the gateway: answered at once, and only for your own prompts.

``POST /interrupt``, ``POST /queue`` (``delete``, ``clear``), ``POST /history`` (``delete``,
``clear``) and ``POST /api/jobs/{id}/cancel`` are not GPU work: queued, they would arrive after
the prompt they mean to stop. And on a shared node they act on everybody's prompts
(``/interrupt {}`` stops whatever runs, ``clear`` empties the whole queue). Behind the gateway
they act only on prompts that the same key submitted through it, as the route's record
(comfy_record.py) has them, or in cluster mode through any gateway (cluster/comfylists.py). A
request about someone else's prompt gets ComfyUI's own answer for a prompt that is not there
(200, nothing done), so prompt ids of other keys cannot be probed. The admin key acts on every
prompt, and so does every key of a ``comfy.shared`` route.

The read views (comfy_views.py) and the websocket (comfy_hub.py) are dispatched from here too,
and the per-runtime ComfyUI state lives here: the routes' records, the node monitors, the hub.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.comfy_hub import ENDED, Hub, ws_event
from kilolined.adapters.comfy_monitor import Monitors, NodeMonitor
from kilolined.adapters.comfy_node import NodeAPI, NodeError, all_ids, find_entry, node_api
from kilolined.adapters.comfy_record import (
    ENTRIES_MAX,
    EVERYONE,
    Prompt,
    PromptOwners,
    Queued,
    Viewer,
    entry_as_given,
    pending_of,
    record_of,
    record_of_queued,
    removable,
)
from kilolined.adapters.comfy_store import claim_names, executed_for_client, history_for_client
from kilolined.adapters.comfy_views import Views, view_of
from kilolined.core import comfy_jobs
from kilolined.core.errors import error_response
from kilolined.ops.runtime import Runtime
from kilolined.wire import expect

log = logging.getLogger("kilolined")

WS_MAX_MSG = 64 * 1024 * 1024
STATE_KEY = "comfyui"
QUEUED_ELSEWHERE = ""  # the node of a prompt in another gateway's own queue (cluster mode): none yet
MONITOR_WAIT_SEC = 2.0  # a client's socket or a prompt waits this long at most for the nodes' monitors
FEATURES_FALLBACK = {"supports_preview_metadata": True}


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


class ComfyState:
    """What the ComfyUI adapter keeps across requests of one runtime."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.monitors = Monitors(rt.spawn)
        self.routes: dict[str, PromptOwners] = {}
        #: route → the prompts in the gateway's own queue, not yet on a node (by ``id()``)
        self.queued: dict[str, dict[int, Queued]] = {}
        #: route → the last number the gateway gave a prompt it queued itself
        self.numbers: dict[str, float] = {}
        #: (route, prompt id) → the number a POST /prompt answered early was given, until its job runs
        self.early: dict[tuple[str, str], float] = {}
        self.activity = NodeActivity()
        #: (route, key dir) → the lock of a key's settings read-merge-write, while one runs
        self.user_locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()
        #: the client id every prompt is sent under, on every node: the monitors listen as it
        self.hub_id = f"kilolined-monitor-{uuid.uuid4().hex}"
        self.hub = Hub(self.owners, self.routes_of, functools.partial(executed_for_client, rt), rt.comfy_ws,
                       self.queued_by_key)
        if rt.comfy_ws is not None:  # cluster mode: frames and counts of prompts other gateways run
            rt.comfy_ws.on_frame, rt.comfy_ws.on_counts = self.hub.remote, self.hub.status_of

    def owners(self, route: str) -> PromptOwners:
        got = self.routes.get(route)
        if got is None:
            got = self.routes[route] = PromptOwners()
        if got.listen is None and self.rt.comfy_lists is not None:
            got.listen = functools.partial(self._changed, route)
        return got

    def _changed(self, route: str, prompt_id: str, p: Prompt) -> None:
        """Cluster mode: a prompt of this gateway's on a node now, or ended, for every gateway's
        queue (cluster/comfylists.py). An ended prompt with an entry leaves the queue when its
        entry is shared (``share_entry``), so no gateway sees it in neither."""
        lists = self.rt.comfy_lists
        if lists is None or (p.ended and p.entry is not None):
            return
        lists.waiting_now(route, prompt_id, None if p.ended else record_of(p), self.max_age(route))

    def max_age(self, route: str) -> float:
        """How long a waiting prompt's records are kept in Redis (a prompt is stopped by then)."""
        rcfg = self.rt.cfg.routes.get(route)
        return 2 * (rcfg.request_timeout_sec if rcfg is not None else self.rt.cfg.jobs.result_ttl_sec)

    async def drop(self, route: str, prompt_ids: list[str]) -> None:
        """A client deletes these prompts from their nodes' queues: whichever gateway holds one
        ends it when it vanishes there, and never re-queues it. Called before the nodes are told."""
        owners = self.owners(route)
        for pid in prompt_ids:
            owners.drop(pid)
        lists = self.rt.comfy_lists
        if lists is not None:
            await lists.drop(route, [pid for pid in prompt_ids if owners.get(pid) is None], self.max_age(route))

    def queue_in(self, route: str, q: Queued) -> Callable[[], None]:
        """``q`` waits in the gateway's queue of ``route``; the returned call says it left (its
        request ended). In cluster mode a listed one is in every gateway's queue too, until a
        node takes it (its record is then the node's) or it ends without one."""
        self.queued.setdefault(route, {})[id(q)] = q
        lists = self.rt.comfy_lists
        if lists is not None and q.item is not None and q.prompt_id is not None:
            lists.waiting_now(route, q.prompt_id, record_of_queued(q), self.max_age(route))

        def left() -> None:
            on_route = self.queued.get(route)
            if on_route is not None:
                on_route.pop(id(q), None)
                if not on_route:
                    del self.queued[route]
            if lists is not None and q.item is not None and q.prompt_id is not None and \
                    self.owners(route).get(q.prompt_id) is None:
                lists.waiting_now(route, q.prompt_id, None, self.max_age(route))  # no node ever took it

        return left

    def unqueue(self, route: str, viewer: Viewer, ids: set[str] | None) -> bool:
        """Take the viewer's prompts that ``ids`` name (None: all) out of the gateway's queue."""
        taken = [q.take() for q in removable(self.queued.get(route, {}), viewer, ids)]
        if any(taken):
            self.hub.status_of(route)  # the route's queue shrank, as ComfyUI says of a delete
        return any(taken)

    async def unqueue_elsewhere(self, route: str, prompt_ids: list[str]) -> bool:
        """Cluster mode: take these prompts, which wait in another gateway's own queue, out of
        it: marked dropped (that gateway ends each when its turn comes, and never sends it to a
        node) and out of every gateway's queue now. True when there was one."""
        lists = self.rt.comfy_lists
        if lists is None or not prompt_ids:
            return False
        await self.drop(route, prompt_ids)
        for pid in prompt_ids:
            lists.waiting_now(route, pid, None, self.max_age(route))
        self.hub.status_of(route)
        return True

    def next_number(self, route: str) -> float:
        """The number of a prompt the gateway queues itself: past every number a client of the
        route was given (a node's, or the gateway's), so the queue lists it after them."""
        n = int(max(self.numbers.get(route, -1), self.owners(route).top)) + 1
        self.numbers[route] = n
        return n

    def pending(self, route: str, viewer: Viewer) -> list[list[Any]]:
        """The viewer's prompts in the gateway's own queue, as ComfyUI lists queued ones, in the
        order they will run."""
        queued = self.queued.get(route)
        if not queued:
            return []
        sched = self.rt.scheduler
        order = sched.positions(route, self.rt.clock()) if route in sched.routes else {}
        return pending_of(queued, viewer, order)

    def views(self, route: str, viewer: Viewer, request_id: str) -> Views:
        return Views(self.rt, route, self.owners(route), viewer, request_id,
                     functools.partial(self.pending, route, viewer), functools.partial(self.queued_ids, route))

    def queued_ids(self, route: str) -> set[str]:
        return {q.prompt_id for q in self.queued.get(route, {}).values() if q.prompt_id is not None}

    def queued_by_key(self, route: str) -> Counter[str]:
        """How many prompts of each key wait in the gateway's own queue (the route's ``status``)."""
        return Counter(q.subject for q in self.queued.get(route, {}).values() if q.listed())

    async def dropped(self, route: str, prompt_id: str) -> bool:
        """Whether a client deleted the prompt from its node's queue (through any gateway)."""
        p = self.owners(route).get(prompt_id)
        if p is not None and p.dropped:
            return True
        lists = self.rt.comfy_lists
        return lists is not None and await lists.dropped(route, prompt_id)

    async def share_entry(self, route: str, prompt_id: str | None) -> None:
        """Cluster mode: the prompt's history entry, as its client was given it, for every
        gateway's ``/history`` and jobs list (cluster/comfylists.py)."""
        lists = self.rt.comfy_lists
        p = self.owners(route).get(prompt_id)
        if lists is None or prompt_id is None or p is None or p.entry is None:
            return
        given = entry_as_given(p.entry, p, functools.partial(history_for_client, self.rt, route))
        p.shared = await lists.put_entry(route, prompt_id, p.subject, given,
                                         comfy_jobs.from_history(prompt_id, given), self.rt.cfg.jobs.result_ttl_sec,
                                         ENTRIES_MAX)

    async def share_failed(self, route: str, prompt_id: str) -> None:
        """Cluster mode: a prompt that ended in an error, its entry shared as a finished one's
        is (its outputs named on the route first)."""
        p = self.owners(route).get(prompt_id)
        if self.rt.comfy_lists is not None and p is not None and p.entry is not None:
            await claim_names(self.rt, route, p.node, p.entry)
            await self.share_entry(route, prompt_id)

    def routes_of(self, node: str) -> list[str]:
        """The routes whose record may hold prompts on ``node`` (its routes now, and any that has one)."""
        sched = self.rt.scheduler.routes
        return [r for r in self.routes if r in sched and node in sched[r].all_nodes] or \
            [r for r, o in self.routes.items() if any(p.node == node for p in o.waiting(EVERYONE).values())]

    def viewer(self, route: str, subject: str | None) -> Viewer:
        """Whose prompts ``subject`` sees on ``route`` (None: the admin key)."""
        rcfg = self.rt.cfg.routes.get(route)
        return EVERYONE if subject is None or (rcfg is not None and rcfg.comfy.shared) else Viewer(subject)

    async def ready(self, route: str) -> None:
        """Start the monitors of the route's nodes and wait (briefly, once) until they listen: a
        prompt sent before its node's monitor listens would have its first events lost."""
        if self.rt.comfy_ws is not None:
            await self.rt.comfy_ws.look(route)  # who listens elsewhere, before the prompt's first frame
        rq = self.rt.scheduler.routes.get(route)
        if rq is None:
            return
        mons = [self.monitor(n) for n in rq.all_nodes if n in self.rt.scheduler.nodes]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MONITOR_WAIT_SEC
        for mon in mons:
            # Only a monitor's first attempt is waited for: a node whose socket fails costs no
            # prompt a wait (its events are lost until the monitor connects again).
            while not mon.tried and mon.running and loop.time() < deadline:
                await mon.changed(mon.version, deadline - loop.time())

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

        async def frame(msg: aiohttp.WSMessage) -> None:
            await self._frame(node, msg)

        return self.monitors.get(node, lambda: NodeMonitor(node, connect, alive, heard, self.hub_id, frame))

    async def tell(self, route: str, node: str, prompt_id: str, msg: aiohttp.WSMessage) -> None:
        """A frame of an sse/async job's own socket to the hub: an ``executed`` event's outputs
        are named (cluster-wide, comfy_store.claim_names) before a client sees the names."""
        got = ws_event(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else None
        if got is not None and got[0] == "executed" and got[1].get("prompt_id", prompt_id) == prompt_id:
            await claim_names(self.rt, route, node, {"outputs": {"-": got[1].get("output")}})
        self.hub.relay(node, prompt_id, msg)

    async def _frame(self, node: str, msg: aiohttp.WSMessage) -> None:
        """One frame of ``node``'s monitor: the record learns how its prompts end, then the hub
        hands it on. A prompt's final ``executing`` (sent after ComfyUI wrote its history) waits
        for its entry, so a client that reads ``/history`` on it finds the prompt there."""
        if msg.type == aiohttp.WSMsgType.BINARY:
            self.hub.preview(node, msg.data)
            return
        got = ws_event(msg.data)
        if got is None:
            return
        kind, data = got
        pid = data.get("prompt_id")
        if kind == "executed" and isinstance(pid, str):
            for route in self.hub.routes_of_prompt(node, pid):
                p = self.owners(route).get(pid)
                assert p is not None
                p.output_seen = True  # lost from here on, it is not re-run elsewhere
                await claim_names(self.rt, route, node, {"outputs": {"-": data.get("output")}})
        if isinstance(pid, str) and (kind in ENDED or (kind == "executing" and data.get("node", "") is None)):
            for route in self.hub.routes_of_prompt(node, pid):
                owners = self.owners(route)
                p = owners.get(pid)
                assert p is not None
                if kind == "executing" and p.entry is None:
                    entry = await self._entry(node, pid, p.node_number)
                    if entry is not None:
                        await claim_names(self.rt, route, node, entry)  # named before /history shows it
                    owners.end(pid, entry)
                else:
                    p.ended = True
        self.hub.event(node, kind, data, msg.data)

    async def _entry(self, node: str, pid: str, number: float | None) -> dict[str, Any] | None:
        if node not in self.rt.scheduler.nodes:
            return None
        try:
            return find_entry(await node_api(self.rt, node, "-").get_json("/history/" + quote(pid, safe="")), pid,
                              number)
        except NodeError:
            return None

    async def features(self, route: str) -> Any:
        """A live node's ``/features`` (the web UI reads its upload limit there)."""
        rq = self.rt.scheduler.routes.get(route)
        for node in (self.rt.scheduler.usable(rq, self.rt.clock()) or rq.all_nodes) if rq is not None else ():
            try:
                got = await node_api(self.rt, node, "-").get_json("/features")
            except NodeError:
                continue
            if isinstance(got, dict):
                return got
        return FEATURES_FALLBACK


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
    if p in ("/interrupt", "/queue", "/history"):
        return p[1:]
    if path == "/api/jobs/cancel":
        return "cancel_many"
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "api", "jobs"] and parts[4] == "cancel" and parts[3]:
        return "cancel"
    return None


def is_socket(request: web.Request, path: str) -> bool:
    return request.method == "GET" and path in ("/ws", "/api/ws") and \
        request.headers.get("Upgrade", "").lower() == "websocket"


async def control(rt: Runtime, request: web.Request, route: str, path: str, subject: str | None,
                  request_id: str) -> web.StreamResponse | None:
    """The answer to a control request, a read view or the websocket, or None when ``path`` is
    none of them. ``subject`` None: the admin key (sees and acts on every prompt)."""
    state = comfy_state(rt)
    viewer = state.viewer(route, subject)
    headers = {"X-Request-Id": request_id}
    if is_socket(request, path):
        await state.ready(route)
        return await state.hub.serve(request, route, viewer, lambda: state.features(route), headers)
    view = view_of(request.method, path)
    if view is not None:
        handler, arg = view
        resp = await handler(state.views(route, viewer, request_id), request, arg)
        resp.headers.update(headers)
        return resp
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
    owners = state.owners(route)
    mine = await _reach(rt, route, owners, viewer, request_id) if action != "history" else {}
    stopping(owners, mine, stop_asked(action, path, body))
    mark = functools.partial(stopping, owners, mine)
    try:
        if action == "interrupt":
            await _interrupt(rt, mine, body.get("prompt_id"), path, request_id, mark)
        elif action == "queue":
            await _queue(rt, state, route, viewer, mine, body, path, request_id)
        elif action == "history":
            await _history(rt, route, owners, viewer, body, path, request_id)
        elif action == "cancel":
            jid = path.split("/")[3]
            node = mine.get(jid)
            if node == QUEUED_ELSEWHERE:
                return web.json_response({"cancelled": await state.unqueue_elsewhere(route, [jid])}, headers=headers)
            if node is None or node not in rt.scheduler.nodes:
                return web.json_response({"cancelled": state.unqueue(route, viewer, {jid})}, headers=headers)
            await state.drop(route, await _pending(rt, {jid: node}, request_id))
            status, answer, ctype = await node_api(rt, node, request_id).post(path, {})
            if status in (404, 405):  # a build without the cancel endpoint (0.19.3): interrupt or dequeue
                return web.json_response({"cancelled": await _cancel(rt, node, jid, request_id)}, headers=headers)
            return web.Response(status=status, body=answer, headers={**headers, "Content-Type": ctype})
        else:
            ids = body.get("job_ids")
            if not isinstance(ids, list):
                return web.json_response({"error": "job_ids must be a list"}, status=400, headers=headers)
            cancelled = state.unqueue(route, viewer, {pid for pid in ids if isinstance(pid, str)})
            cancelled |= await state.unqueue_elsewhere(route, _elsewhere(mine, ids))
            by_node = _by_node(rt, mine, ids)
            await state.drop(route, await _pending(rt, {pid: n for n, pids in by_node.items() for pid in pids},
                                                   request_id))
            for node, pids in by_node.items():
                status, answer, _ = await node_api(rt, node, request_id).post(path, {"job_ids": pids})
                if status in (404, 405):
                    for pid in pids:
                        cancelled |= await _cancel(rt, node, pid, request_id)
                else:
                    cancelled |= status == 200 and b"true" in answer
            return web.json_response({"cancelled": cancelled}, headers=headers)
    except NodeError as e:
        return error_response(502, "upstream_error", e.reason, request_id=request_id)
    return web.Response(status=200, headers=headers)


def stop_asked(action: str, path: str, body: dict[str, Any]) -> list[str]:
    """The prompts a control request names to stop (an interrupt naming none stops what the node
    says runs: marked where that is known). A dequeued prompt is ``ComfyState.drop``'s."""
    if action == "interrupt":
        pid = body.get("prompt_id")
        return [pid] if isinstance(pid, str) and pid else []
    if action == "cancel":
        return [path.split("/")[3]]
    if action == "cancel_many" and isinstance(body.get("job_ids"), list):
        return [p for p in body["job_ids"] if isinstance(p, str)]
    return []


def stopping(owners: PromptOwners, mine: dict[str, str], pids: list[str]) -> None:
    """Marked before the node is asked: a node that dies before the stop lands (ComfyUI stops
    a prompt at its next progress step) must not have the prompt re-run on another."""
    for pid in pids:
        p = owners.get(pid)
        if p is not None and pid in mine and not p.ended:
            p.stopped = True


async def _cancel(rt: Runtime, node: str, pid: str, request_id: str) -> bool:
    """Cancel one prompt where the node has no jobs API: interrupt it if it runs, else dequeue it."""
    api = node_api(rt, node, request_id)
    queue = await api.get_json("/queue")
    queue = queue if isinstance(queue, dict) else {}
    if pid in all_ids(queue.get("queue_running")):
        await api.post("/interrupt", {"prompt_id": pid})
        return True
    if pid in all_ids(queue.get("queue_pending")):
        await api.post("/queue", {"delete": [pid]})
        return True
    return False


async def _reach(rt: Runtime, route: str, owners: PromptOwners, viewer: Viewer, request_id: str) -> dict[str, str]:
    """prompt id → node of the prompts ``viewer`` may act on: the record's, and in cluster mode
    those on a node through another gateway (acted on where they are)."""
    mine = owners.mine(viewer.subject)
    if rt.comfy_lists is None:
        return mine
    there = await comfy_state(rt).views(route, viewer, request_id).waiting()
    return {**{pid: p.node for pid, p in there.items()}, **mine}


def _elsewhere(mine: dict[str, str], ids: list[Any] | None) -> list[str]:
    """The prompts of ``ids`` (None: all) of ``mine`` that wait in another gateway's own queue."""
    return [pid for pid, node in mine.items() if node == QUEUED_ELSEWHERE and (ids is None or pid in ids)]


def _by_node(rt: Runtime, mine: dict[str, str], ids: list[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for pid in ids:
        node = mine.get(pid) if isinstance(pid, str) else None
        if node is not None and node in rt.scheduler.nodes:
            out.setdefault(node, []).append(pid)
    return out


async def _queues(rt: Runtime, mine: dict[str, str], request_id: str) -> list[tuple[NodeAPI, dict[str, Any], set[str]]]:
    """(node, its /queue, the prompt ids of ``mine`` on it) for every node holding one of them."""
    nodes: dict[str, set[str]] = {}
    for pid, node in mine.items():
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


async def _interrupt(rt: Runtime, mine: dict[str, str], prompt_id: Any, path: str, request_id: str,
                     mark: Callable[[list[str]], None]) -> None:
    """``mine``: the prompts the caller may act on, and their nodes."""
    if prompt_id:
        node = mine.get(prompt_id) if isinstance(prompt_id, str) else None
        if node is not None and node in rt.scheduler.nodes:
            await node_api(rt, node, request_id).post(path, {"prompt_id": prompt_id})
        return
    # No id: ComfyUI would stop whatever runs; here, the key's own running prompt(s) only.
    for api, queue, on_node in await _queues(rt, mine, request_id):
        for pid in all_ids(queue.get("queue_running")):
            if pid in on_node:
                mark([pid])
                await api.post(path, {"prompt_id": pid})


async def _pending(rt: Runtime, mine: dict[str, str], request_id: str) -> list[str]:
    """The prompts of ``mine`` that wait in their node's queue now (not running, not ended)."""
    return [pid for _, queue, on_node in await _queues(rt, mine, request_id)
            for pid in all_ids(queue.get("queue_pending")) if pid in on_node]


async def _queue(rt: Runtime, state: ComfyState, route: str, viewer: Viewer, mine: dict[str, str],
                 body: dict[str, Any], path: str, request_id: str) -> None:
    """``POST /queue``: ``delete`` the listed prompts of the caller's that wait in a node's queue,
    ``clear`` all of them. Each is marked dropped first (``ComfyState.drop``): the gateway holding
    it must not take its vanishing from the node for a lost node and run it elsewhere. The
    caller's prompts still in the gateway's own queue go too (by the ``prompt_id`` they gave)."""
    delete = body.get("delete")
    if body.get("clear"):
        state.unqueue(route, viewer, None)
        await state.unqueue_elsewhere(route, _elsewhere(mine, None))
    elif isinstance(delete, list):
        state.unqueue(route, viewer, {pid for pid in delete if isinstance(pid, str)})
        await state.unqueue_elsewhere(route, _elsewhere(mine, delete))
    listed = {pid: mine[pid] for pid in delete if isinstance(pid, str) and pid in mine} \
        if isinstance(delete, list) else {}
    for api, queue, on_node in await _queues(rt, mine if body.get("clear") else listed, request_id):
        pending = [pid for pid in all_ids(queue.get("queue_pending")) if pid in on_node]
        if pending:
            await state.drop(route, pending)
            await api.post(path, {"delete": pending})


async def _history(rt: Runtime, route: str, owners: PromptOwners, viewer: Viewer, body: dict[str, Any],
                   path: str, request_id: str) -> None:
    """``POST /history``: ``clear`` forgets the viewer's history, ``delete`` the listed prompts of
    theirs. The route's history is the gateway's: a node is told to delete only the viewer's own
    prompts, and never to clear (that would take everybody's)."""
    ended: dict[str, str | None] = {pid: p.node for pid, p in owners.history(viewer)}
    lists = rt.comfy_lists
    if lists is not None:  # cluster mode: the viewer's prompts ended through the other gateways too
        ended = {**dict.fromkeys(await lists.ended(route, viewer.subject) or ()), **ended}
    delete = body.get("delete")
    gone = set(ended) if body.get("clear") else set()
    if isinstance(delete, list):
        gone |= {pid for pid in delete if isinstance(pid, str) and pid in ended}
    if gone and lists is not None:
        await lists.forget_entries(route, sorted(gone))  # gone from every gateway's history
    by_node: dict[str, list[str]] = {}
    for pid in sorted(gone):
        owners.forget(pid)
        node = ended[pid]
        if node is not None and node in rt.scheduler.nodes:
            by_node.setdefault(node, []).append(pid)
    for node, pids in by_node.items():
        await node_api(rt, node, request_id).post(path, {"delete": pids})
