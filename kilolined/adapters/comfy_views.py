"""ComfyUI's read endpoints of a route, answered by the gateway: one history, one queue, one jobs
list over every node, from the route's record (comfy_record.py), in ComfyUI's shapes.

- ``GET /history``, ``/history/{id}``: the viewer's ended prompts, in the order they ended; an
  entry the record has not read yet (the prompt ended a moment ago) is asked of its node.
- ``GET /queue``: the queues of the nodes that hold the viewer's prompts, kept to those prompts,
  then the viewer's prompts still in the gateway's own queue, in the order they will run.
- ``GET /prompt``: ``queue_remaining`` over the route (the viewer's prompts not yet ended).
- ``GET /api/jobs``, ``/api/jobs/{id}``: ComfyUI's jobs records of the same (core/comfy_jobs.py).
In cluster mode each also holds the prompts sent through the other gateways
(cluster/comfylists.py): their ended ones from Redis, in the order they ended; the ones on a
node now from their waiting records, asked of their nodes as this gateway's own are.
Each answers in ``/x`` and ``/api/x`` form. Another key's prompt is a prompt that is not there.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from aiohttp import web

from kilolined.adapters.comfy_node import NodeAPI, NodeError, find_entry, node_api
from kilolined.adapters.comfy_record import (
    Names,
    Prompt,
    PromptOwners,
    Viewer,
    as_given,
    entry_as_given,
    prompt_of,
    queued_item,
)
from kilolined.adapters.comfy_store import history_for_client
from kilolined.core import comfy_jobs
from kilolined.ops.runtime import Runtime

View = Callable[["Views", web.Request, str], Awaitable[web.Response]]


def view_of(method: str, path: str) -> tuple[View, str] | None:
    """The view that answers ``method path``, and the path's argument (a prompt id), or None."""
    if method != "GET":
        return None
    plain = path[4:] if path.startswith("/api/") else path
    if plain == "/history":
        return Views.history, ""
    if plain.startswith("/history/") and plain.count("/") == 2 and len(plain) > 9:
        return Views.history_item, plain[9:]
    if plain == "/queue":
        return Views.queue, ""
    if plain == "/prompt":
        return Views.prompt, ""
    if path == "/api/jobs":
        return Views.jobs, ""
    if path.startswith("/api/jobs/") and path.count("/") == 3 and len(path) > 10:
        return Views.job, path[10:]
    return None


def _nothing_queued() -> list[list[Any]]:
    return []


def _none_here() -> set[str]:
    return set()


class Views:
    def __init__(self, rt: Runtime, route: str, owners: PromptOwners, viewer: Viewer, request_id: str,
                 queued: Callable[[], list[list[Any]]] = _nothing_queued,
                 queued_here: Callable[[], set[str]] = _none_here):
        self.rt, self.route, self.owners, self.viewer, self.request_id = rt, route, owners, viewer, request_id
        #: the viewer's prompts in the gateway's own queue, as ComfyUI lists queued ones, in run order
        self.queued = queued
        self.queued_here = queued_here  # the prompt ids of every prompt in this gateway's own queue
        #: cluster mode: those in the other gateways' own queues, by number (read by ``waiting``)
        self.there_queued: list[list[Any]] = []
        self.names: Names = functools.partial(history_for_client, rt, route)  # the route's file names

    def _given(self, entry: dict[str, Any], p: Prompt) -> dict[str, Any]:
        return entry_as_given(entry, p, self.names)

    def _api(self, node: str) -> NodeAPI | None:
        return node_api(self.rt, node, self.request_id) if node in self.rt.scheduler.nodes else None

    async def _entry(self, pid: str, p: Prompt) -> dict[str, Any] | None:
        """The prompt's history entry: the record's, else its node's if it has ended there."""
        if p.entry is not None or p.ended:
            return p.entry
        api = self._api(p.node)
        if api is None:
            return None
        try:
            entry = find_entry(await api.get_json("/history/" + quote(pid, safe="")), pid, p.node_number)
        except NodeError:
            return None
        if entry is not None:
            self.owners.end(pid, entry)
        return entry

    async def waiting(self) -> dict[str, Prompt]:
        """The viewer's prompts on a node now: this gateway's, and (cluster mode) the other
        gateways' (their waiting records)."""
        mine = self.owners.waiting(self.viewer)
        lists = self.rt.comfy_lists
        if lists is None:
            return mine
        there = {}
        self.there_queued = []
        here = self.queued_here()
        for pid, rec in (await lists.waiting(self.route)).items():
            p = prompt_of(rec)
            if p is not None and self.owners.get(pid) is None and pid not in here and self.viewer.sees(p):
                there[pid] = p
                if (item := queued_item(rec)) is not None:
                    self.there_queued.append(item)
        self.there_queued.sort(key=lambda item: item[0] if isinstance(item[0], (int, float)) else 0)
        return {**there, **mine}

    async def _queues(self) -> tuple[list[list[Any]], list[list[Any]]]:
        """(running, pending) items of the viewer's prompts over every node that holds one."""
        waiting = await self.waiting()
        nodes = sorted({p.node for p in waiting.values()})
        apis = [(n, api) for n in nodes if (api := self._api(n)) is not None]
        got = await asyncio.gather(*(api.get_json("/queue") for _, api in apis), return_exceptions=True)
        running: list[list[Any]] = []
        pending: list[list[Any]] = []
        for (node, _), queue in zip(apis, got, strict=True):
            if not isinstance(queue, dict):
                if isinstance(queue, BaseException) and not isinstance(queue, Exception):
                    raise queue
                continue  # a node that does not answer holds nothing we can show
            for items, out in ((queue.get("queue_running"), running), (queue.get("queue_pending"), pending)):
                for item in items if isinstance(items, list) else ():
                    p = waiting.get(item[1]) if isinstance(item, list) and len(item) > 1 else None
                    if p is not None and p.node == node:
                        out.append(as_given(item, p))
        pending.sort(key=lambda item: item[0] if isinstance(item[0], (int, float)) else 0)
        # What waits in the gateways' own queues runs after: this one's, then (cluster mode) the others'.
        return running, pending + self.queued() + self.there_queued

    async def _ended(self) -> tuple[list[str], dict[str, Prompt]]:
        """The viewer's ended prompts with an entry, in the order they ended (cluster mode:
        every gateway's as Redis orders them, then this one's not shared yet: one that was is
        the route's history's only while Redis has it, deleted through any gateway or expired),
        and this gateway's own among them."""
        local = {pid: p for pid, p in self.owners.history(self.viewer) if p.entry is not None}
        lists = self.rt.comfy_lists
        if lists is None:
            return list(local), local
        shared = await lists.ended(self.route, self.viewer.subject)
        if shared is None:
            return list(local), local  # Redis does not answer: this gateway's own, as it has them
        known = set(shared)
        return shared + [pid for pid, p in local.items() if pid not in known and not p.shared], local

    async def _entries(self, pids: list[str], local: dict[str, Prompt]) -> dict[str, dict[str, Any]]:
        """The entries of ``pids`` as their clients were given them, in that order."""
        lists = self.rt.comfy_lists
        there = (await lists.entries(self.route, [pid for pid in pids if pid not in local]) or {}) \
            if lists is not None else {}
        out = {}
        for pid in pids:
            p = local.get(pid)
            if p is not None and p.entry is not None:
                out[pid] = self._given(p.entry, p)
            elif pid in there and self._may_see(there[pid][0]):
                out[pid] = there[pid][1]
        return out

    def _may_see(self, subject: str) -> bool:
        return self.viewer.subject is None or subject == self.viewer.subject

    # --- the views -----------------------------------------------------------------------------
    async def history(self, request: web.Request, _: str) -> web.Response:
        ids, local = await self._ended()
        try:
            max_items = int(request.query["max_items"]) if "max_items" in request.query else None
            offset = int(request.query.get("offset", "-1"))
        except ValueError:
            return web.json_response({"error": "max_items and offset must be integers"}, status=400)
        # ComfyUI's paging: a negative offset with max_items means "the last max_items".
        if offset < 0:
            offset = max(len(ids) - max_items, 0) if max_items is not None else 0
        end = offset + max_items if max_items is not None else None
        return web.json_response(await self._entries(ids[offset:end], local))

    async def _elsewhere(self, pid: str, p: Prompt | None) -> tuple[bool, dict[str, Any] | None]:
        """Cluster mode, for a prompt this gateway does not have (``p`` None) or whose entry it
        shared: (whether Redis has the say, the entry as its client was given it if the viewer
        sees it). A shared entry is the route's only while Redis has it (deleted through any
        gateway, it is gone); while Redis does not answer, this gateway's own copy stands."""
        lists = self.rt.comfy_lists
        if lists is None or (p is not None and not p.shared):
            return False, None
        got = await lists.entries(self.route, [pid])
        if got is None:
            return p is None, None
        doc = got.get(pid)
        return True, doc[1] if doc is not None and self._may_see(doc[0]) else None

    async def history_item(self, request: web.Request, pid: str) -> web.Response:
        p = self.owners.get(pid)
        told, there = await self._elsewhere(pid, p)
        if told:
            return web.json_response({pid: there} if there is not None else {})
        entry = await self._entry(pid, p) if p is not None and self.viewer.sees(p) else None
        return web.json_response({pid: self._given(entry, p)} if entry is not None and p is not None else {})

    async def queue(self, request: web.Request, _: str) -> web.Response:
        running, pending = await self._queues()
        return web.json_response({"queue_running": running, "queue_pending": pending})

    async def prompt(self, request: web.Request, _: str) -> web.Response:
        return web.json_response({"exec_info": {"queue_remaining": len(await self.waiting()) + len(self.queued())}})

    async def jobs(self, request: web.Request, _: str) -> web.Response:
        running, pending = await self._queues()
        ids, local = await self._ended()
        finished = [comfy_jobs.from_history(pid, self._given(p.entry, p)) for pid in ids
                    if (p := local.get(pid)) is not None and p.entry is not None]
        lists = self.rt.comfy_lists
        if lists is not None:
            finished += (await lists.jobs(self.route, [pid for pid in ids if pid not in local])).values()
        status, body = comfy_jobs.listing_of(running, pending, finished, request.query)
        return web.json_response(body, status=status)

    async def job(self, request: web.Request, pid: str) -> web.Response:
        p = self.owners.get(pid)
        job = None
        told, there = await self._elsewhere(pid, p)
        if there is not None:
            job = comfy_jobs.find(pid, [], [], {pid: there})
        elif told and p is None:
            running, pending = await self._queues()  # on a node through another gateway
            job = comfy_jobs.find(pid, running, pending, {})
        elif not told and p is not None and self.viewer.sees(p):
            entry = await self._entry(pid, p)
            if entry is not None:
                job = comfy_jobs.find(pid, [], [], {pid: self._given(entry, p)})
            else:
                running, pending = await self._queues()
                job = comfy_jobs.find(pid, running, pending, {})
        if job is None and p is None:  # in the gateway's own queue
            job = comfy_jobs.find(pid, [], self.queued(), {})
        if job is None:
            return web.json_response({"error": "Job not found"}, status=404)
        return web.json_response(job)
