"""Requests on ``unqueued_paths``: forwarded at once, without a slot (status, history, files).

They need the key but skip rate limits and budgets (status pages poll often) and never wait.
They go to the first node that is up; a node that fails one before answering hands it to the
next (nginx's ``proxy_next_upstream error``): a dead node's health check takes tens of seconds to
tell, a page (ComfyUI's web UI: ~160 requests) is over in a few.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kilolined.core.config import RouteConfig
from kilolined.core.outcome import Failure
from kilolined.modes.call import Call
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Rejected
from kilolined.wire import expect
from kilolined.wire.proxy import (
    Exchange,
    Upstream,
    UpstreamFailed,
    cut_client,
    open_upstream,
    response_headers,
    stream_back,
)
from kilolined.wire.wsproxy import proxy_websocket

log = logging.getLogger("kilolined")


IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
# Given a node's answer (its head read, the client's headers made), answers the client itself
# (reading the body), or None: the answer streams back as it is. Raises UpstreamFailed when the
# node fails it before the client was sent anything (the next node is asked).
Keep = Callable[[Upstream, CIMultiDict[str], str], Awaitable[web.StreamResponse | None]]


def next_upstream(e: UpstreamFailed, method: str) -> bool:
    """May a request the node failed go to the next node? One the node never got (no connection),
    whatever its method; an idempotent one it dropped without a word. Not after an answer, nor a
    timeout (the node may still be working on it) — nginx's default, without non_idempotent."""
    if e.answered or e.timeout:
        return False
    return e.unsent or method in IDEMPOTENT


async def forward_unqueued(rt: Runtime, call: Call, rcfg: RouteConfig, keep: Keep | None = None) -> web.StreamResponse:
    """Pass-through without a slot, to the first node that is up (primaries first); ``keep`` may
    take the node's answer (the web UI's hashed files: edge/page_assets.py)."""
    sched = rt.scheduler
    nodes = sched.answering(sched.routes[call.route_name], rt.clock())
    method = call.request.method
    websocket = call.request.headers.get("Upgrade", "").lower() == "websocket"
    ex: Exchange | None = None
    if not websocket:
        if call.request.can_read_body:
            expect.let_body_come(call.request)
            body = await call.request.read()
        else:
            body = b""
        ex = Exchange(call.request, method, call.tail, body, call.request_id, call.client_ip, call.trusted_peer)
        try:
            call.adapter.prepare(ex)  # e.g. comfyui drops Origin (ComfyUI answers 403 otherwise)
        except Rejected as r:
            return call.rejected(r)
    for i, node in enumerate(nodes):
        call.node = node
        try:
            if ex is None:
                ns = sched.nodes[node]
                return await proxy_websocket(
                    call.request, rt.session(node), ns.cfg.url + call.tail,
                    {"X-Request-Id": call.request_id, **ns.cfg.headers},
                    response_headers={"X-Request-Id": call.request_id, "X-KiloLine-Node": node})
            return await _forward(rt, call, rcfg, ex, node, keep)
        except UpstreamFailed as e:
            if not (e.answered or e.timeout):
                sched.nodes[node].lost(rt.clock())  # the next request tries the others first
            if i + 1 < len(nodes) and next_upstream(e, method):
                log.info("[%s] %s: %s %s goes to the next node", node, e.reason, method, call.tail.split("?", 1)[0])
                continue
            return _failed(call, node, e)
    raise AssertionError("a route has a node")


async def _forward(rt: Runtime, call: Call, rcfg: RouteConfig, ex: Exchange, node: str,
                   keep: Keep | None) -> web.StreamResponse:
    """The node's answer streamed back (or kept); UpstreamFailed before any byte of it."""
    ns = rt.scheduler.nodes[node]
    up = await open_upstream(rt.pool(node), ex, ns.cfg.url, ns.cfg.headers, rcfg.request_timeout_sec)
    headers = response_headers(up, ns.cfg.url, rcfg.path if rcfg.strips_path else "/")
    headers["X-Request-Id"] = call.request_id
    headers["X-KiloLine-Node"] = node
    try:
        kept = await keep(up, headers, node) if keep is not None else None
        if kept is not None:
            return kept
        resp, call.bytes_out = await stream_back(call.request, up, headers)
        return resp
    except ConnectionResetError:
        raise  # the client left
    except (aiohttp.ClientError, TimeoutError):
        cut_client(call.request)
        raise web.HTTPBadGateway() from None
    finally:
        up.release()


def _failed(call: Call, node: str, e: UpstreamFailed) -> web.Response:
    f = Failure.upstream(f"node {node} did not answer in time" if e.timeout else f"node {node} failed: {e.reason}",
                         e.timeout)
    return call.error(f.http_status or 502, f.type, f.message)
