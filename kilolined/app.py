"""The aiohttp application and the request pipeline, in the order a request lives it:

    auth → route → rate limit / budget → admission (queue) → lease (slot on a node)
         → adapter → upstream → response or job events → release
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlencode

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters import Adapter, GenericAdapter, adapter_for
from kilolined.adapters.openai import wants_stream
from kilolined.auth import Principal, presented_key
from kilolined.config import RateConfig, RouteConfig
from kilolined.errors import error_response
from kilolined.forward import Hooks, HttpAttempt, with_retries
from kilolined.limits import seconds_to_midnight
from kilolined.proxy import (
    Exchange,
    UpstreamFailed,
    client_ip,
    cut_client,
    open_upstream,
    request_id,
    response_headers,
    stream_back,
)
from kilolined.queue import Lease, Rejected, Ticket
from kilolined.runtime import Runtime
from kilolined.upstream import UpstreamResponse

log = logging.getLogger("kilolined")
access_log = logging.getLogger("kilolined.access")

RT: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
MODES = ("sync", "sse", "async")


@dataclass(slots=True)
class Call:
    """Everything the pipeline learns about one request, for the response and the access log."""

    request: web.Request
    request_id: str
    started: float
    route: str = "-"
    kind: str = "generic"
    key: str = "-"
    mode: str = "sync"
    node: str = "-"
    status: int = 0
    queue_wait: float = 0.0
    bytes_out: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # rate-limit headers for every response
    adapter: Adapter = field(default_factory=GenericAdapter)

    def error(self, status: int, type_: str, message: str, retry_after: float | None = None) -> web.Response:
        return error_response(status, type_, message, request_id=self.request_id, retry_after=retry_after,
                              headers=self.headers, openai=self.kind == "openai")

    def rejected(self, r: Rejected) -> web.Response:
        return self.error(r.status, r.type, r.message, r.retry_after)


def unqueued(rcfg: RouteConfig, method: str, path: str) -> bool:
    for pat in rcfg.unqueued:
        if " " in pat:
            m, p = pat.split(" ", 1)
            if m.upper() == method and fnmatch.fnmatchcase(path, p):
                return True
        elif fnmatch.fnmatchcase(path, pat):
            return True
    return False


def choose_mode(request: web.Request) -> str | None:
    m = request.headers.get("X-KiloLine-Mode") or request.query.get("kl_mode")
    if m is None:
        prefer = request.headers.get("Prefer", "")
        return "async" if "respond-async" in prefer.lower() else "sync"
    m = m.strip().lower()
    return m if m in MODES else None


def tail_with_query(request: web.Request, tail: str) -> str:
    q = request.rel_url.query
    if "kl_mode" in q:
        rest = [(k, v) for k, v in q.items() if k != "kl_mode"]
        return tail + ("?" + urlencode(rest) if rest else "")
    qs = request.rel_url.raw_query_string
    return tail + ("?" + qs if qs else "")


async def read_exchange(rt: Runtime, call: Call, tail: str, ip: str) -> Exchange | web.Response:
    """The request body (kept for a re-queue) and the adapter's look at it; or the refusal."""
    request = call.request
    try:
        body = await read_body(request, int(rt.cfg.server.max_body_mb * 1024 * 1024))
    except Rejected as r:
        return too_large(call, r)
    ex = Exchange(request, request.method, tail, body, call.request_id, ip)
    try:
        call.adapter.prepare(ex)
    except Rejected as r:
        return call.rejected(r)
    return ex


def too_large(call: Call, r: Rejected) -> web.Response:
    resp = call.rejected(r)
    # Close instead of draining the rest of a body we refused (it may be gigabytes).
    resp.force_close()
    return resp


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise Rejected(413, "payload_too_large", f"body over {limit // (1024 * 1024)} MB")
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise Rejected(413, "payload_too_large", f"body over {limit // (1024 * 1024)} MB")
    return bytes(buf)


# --- the pipeline ------------------------------------------------------------------------------


async def handle_route(request: web.Request) -> web.StreamResponse:
    rt = request.app[RT]
    call = Call(request, request_id(request), time.monotonic())
    try:
        resp = await pipeline(rt, call)
        call.status = resp.status
        return resp
    finally:
        log_access(rt, call)


async def pipeline(rt: Runtime, call: Call) -> web.StreamResponse:
    request = call.request
    if rt.shutting_down:
        return call.error(503, "shutting_down", "the gateway is shutting down", 5)
    # route
    # Route on the raw path so that an encoded "?" or "/" in a segment reaches the node as sent.
    match = rt.router.match(request.rel_url.raw_path)
    if match is None:
        return call.error(404, "not_found", f"no route for {request.path}")
    call.route, tail = match
    rcfg = rt.cfg.routes[call.route]
    call.kind = rcfg.kind
    call.adapter = adapter_for(rcfg.kind)
    # auth
    principal: Principal | None = None
    if rcfg.auth == "required":
        principal = rt.keys.lookup(presented_key(request))
        if principal is None:
            rt.metrics.rejections.labels(call.route, "unauthorized").inc()
            return call.error(401, "unauthorized", "missing or unknown API key")
        if not principal.may_use(call.route):
            rt.metrics.rejections.labels(call.route, "forbidden").inc()
            return call.error(403, "forbidden", f"key {principal.key_id!r} may not use route {call.route!r}")
    ip = client_ip(request, rt.cfg.server.trusted_proxies)
    subject = principal.key_id if principal else f"ip:{ip}"
    call.key = principal.key_id if principal else "-"
    mode = choose_mode(request)
    if mode is None:
        return call.error(400, "bad_request", "X-KiloLine-Mode must be sync, sse or async")
    call.mode = mode
    path_tail = tail_with_query(request, tail)
    # Status, list and file endpoints neither take a slot nor wait behind the queue (SPEC §5).
    if unqueued(rcfg, request.method, unquote(tail)):
        return await forward_unqueued(rt, call, rcfg, path_tail, ip)
    # rate limit and budget
    refused = check_limits(rt, call, principal, subject, rcfg.rate)
    if refused is not None:
        return refused
    ex = await read_exchange(rt, call, path_tail, ip)
    if isinstance(ex, web.Response):
        return ex
    priority = principal.cfg.priority if principal else 0
    return await admit_and_run(rt, call, call.route, ex, principal, priority)


def check_limits(rt: Runtime, call: Call, principal: Principal | None, subject: str,
                 route_rate: RateConfig | None) -> web.Response | None:
    """Token bucket per (subject, route), then the key's daily budget; a 429 or None."""
    rate = (principal.cfg.rate if principal and principal.cfg.rate else None) or route_rate
    if rate is not None:
        v = rt.limiter.check(subject, call.route, rate, rt.clock())
        call.headers.update({"RateLimit-Limit": str(v.limit), "RateLimit-Remaining": str(v.remaining),
                             "RateLimit-Reset": str(v.reset_sec)})
        if not v.ok:
            rt.metrics.rejections.labels(call.route, "rate_limited").inc()
            return call.error(429, "rate_limited", f"rate limit of {rate.per_minute:g}/min exceeded",
                              v.retry_after)
    if principal is not None:
        spent = rt.budgets.exhausted(principal.key_id, principal.cfg.budget, time.time())
        if spent:
            rt.metrics.rejections.labels(call.route, "budget_exhausted").inc()
            return call.error(429, "budget_exhausted", f"daily budget {spent} exhausted",
                              seconds_to_midnight(time.time()))
    return None


async def admit_and_run(rt: Runtime, call: Call, route: str, ex: Exchange, principal: Principal | None,
                        priority: int, pinned_node: str | None = None) -> web.StreamResponse:
    key = principal.key_id if principal else f"ip:{ex.client_ip}"
    # A refused callback must cost nothing: no queue place, no budget.
    callback, refused = await rt.jobs.check_callback(call, principal)
    if refused:
        return call.error(400, "bad_request", f"callback URL refused: {refused}")
    try:
        ticket = rt.admit(route, key, priority, pinned_node=pinned_node)
    except Rejected as r:
        rt.metrics.rejections.labels(rt._route_label(route), r.type).inc()
        return call.rejected(r)
    if principal is not None:
        rt.budgets.add(principal.key_id, time.time(), requests=1)
    if call.mode != "sync":
        return await rt.jobs.submit(call, ticket, ex, principal, callback)
    if call.kind == "openai" and wants_stream(ex):
        from kilolined.llmstream import run_sync_stream

        return await run_sync_stream(rt, call, ticket, ex)
    return await run_sync(rt, call, ticket, ex)


async def run_sync(rt: Runtime, call: Call, ticket: Ticket, ex: Exchange) -> web.StreamResponse:
    """Hold the client while queued, then stream the node's answer (re-queued on a node failure)."""
    label = rt._route_label(ticket.route)
    hooks = SyncHooks(rt, call, label)
    try:
        lease, up = await with_retries(rt, ticket, HttpAttempt(rt, ex), hooks)
    except Rejected as r:
        return call.rejected(r)
    except UpstreamFailed as e:
        rt.metrics.requests.labels(label, "timeout" if e.timeout else "upstream_error").inc()
        if e.timeout:
            return call.error(504, "upstream_timeout", f"node {call.node} did not answer in time")
        return call.error(502, "upstream_error", f"node {call.node} failed: {e.reason}")
    return await relay(rt, call, lease, up, ex, hooks.dispatched_at)


class SyncHooks(Hooks):
    __slots__ = ("call", "dispatched_at", "label", "rt")

    def __init__(self, rt: Runtime, call: Call, label: str):
        self.rt, self.call, self.label = rt, call, label
        self.dispatched_at = 0.0

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        if self.dispatched_at == 0.0:
            self.call.queue_wait = queue_wait
            self.rt.metrics.queue_wait.labels(self.label).observe(queue_wait)
        self.dispatched_at = self.rt.clock()
        self.call.node = lease.node


async def relay(rt: Runtime, call: Call, lease: Lease, up: UpstreamResponse, ex: Exchange,
                dispatched: float) -> web.StreamResponse:
    """Stream the answer back; the slot is freed when the body ends (or on any exit) — unless the
    adapter says the node is still working (ComfyUI), in which case a watcher keeps the slot."""
    label = rt._route_label(lease.route)
    rcfg = rt.scheduler.routes[lease.route].cfg
    headers = response_headers(up, rt.scheduler.nodes[lease.node].cfg.url, rcfg.path)
    headers.update(call.headers)
    headers["X-Request-Id"] = call.request_id
    headers["X-KiloLine-Node"] = lease.node
    headers["X-KiloLine-Queue-Wait-Ms"] = str(int(call.queue_wait * 1000))
    key = call.key if call.key != "-" else None
    obs = call.adapter.observer(rt, ex, label, key, dispatched)
    capture = bytearray() if call.adapter.captures_sync_body(ex) else None
    ok: bool | None = None
    handed_over = False
    try:
        resp, call.bytes_out = await stream_back(call.request, up, headers, obs, capture)
        ok = up.status < 500
        rt.metrics.requests.labels(label, "ok" if ok else "upstream_error").inc()
        hold = call.adapter.sync_hold(rt, lease, ex, up.status, bytes(capture or b""))
        if hold is not None:
            handed_over = True
            rt.spawn(_hold_then_release(rt, lease, hold, key))
        return resp
    except ConnectionResetError:
        # The client hung up (aiohttp's ClientConnectionResetError is also a ClientError, so this
        # comes first): not the node's fault, no breaker count.
        rt.metrics.requests.labels(label, "client_gone").inc()
        raise
    except (aiohttp.ClientError, TimeoutError) as e:
        # The node failed mid-body: no retry is possible once bytes went out; cut the client.
        ok = False
        reason = "timed out mid-response" if isinstance(e, TimeoutError) else "connection lost mid-response"
        rt.node_failure(lease.node, reason, lease.trial)
        rt.metrics.requests.labels(label, "upstream_error").inc()
        cut_client(call.request)
        call.status = 502
        raise web.HTTPBadGateway() from None
    finally:
        up.release()
        if obs is not None:
            obs.done(bool(ok))
        rt.metrics.upstream.labels(label, lease.node).observe(rt.clock() - dispatched)
        if not handed_over:
            rt.release(lease, ok=ok, key=key)


async def _hold_then_release(rt: Runtime, lease: Lease, hold: Coroutine[Any, Any, None], key: str | None) -> None:
    ok: bool | None = None
    try:
        await hold
        ok = True
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("sync hold on %s", lease.node)
        ok = False
    finally:
        rt.release(lease, ok=ok, key=key)


async def forward_unqueued(rt: Runtime, call: Call, rcfg: RouteConfig, tail: str, ip: str) -> web.StreamResponse:
    """Pass-through without a slot, to the first node that is up (primaries first)."""
    now = rt.clock()
    rq = rt.scheduler.routes[call.route]
    usable = rt.scheduler.usable(rq, now) or rq.all_nodes
    node = usable[0]
    ns = rt.scheduler.nodes[node]
    call.node = node
    if call.request.headers.get("Upgrade", "").lower() == "websocket":
        from kilolined.wsproxy import proxy_websocket

        try:
            return await proxy_websocket(
                call.request, rt.session(node), ns.cfg.url + tail, {"X-Request-Id": call.request_id, **ns.cfg.headers},
                response_headers={"X-Request-Id": call.request_id, "X-KiloLine-Node": node})
        except UpstreamFailed as e:
            if e.timeout:
                return call.error(504, "upstream_timeout", f"node {node} did not answer in time")
            return call.error(502, "upstream_error", f"node {node} failed: {e.reason}")
    body = await call.request.read() if call.request.can_read_body else b""
    ex = Exchange(call.request, call.request.method, tail, body, call.request_id, ip)
    try:
        call.adapter.prepare(ex)  # e.g. comfyui drops Origin (ComfyUI answers 403 otherwise)
    except Rejected as r:
        return call.rejected(r)
    try:
        up = await open_upstream(rt.pool(node), ex, ns.cfg.url, ns.cfg.headers, rcfg.request_timeout_sec)
    except UpstreamFailed as e:
        if e.timeout:
            return call.error(504, "upstream_timeout", f"node {node} did not answer in time")
        return call.error(502, "upstream_error", f"node {node} failed: {e.reason}")
    headers = response_headers(up, ns.cfg.url, rcfg.path)
    headers["X-Request-Id"] = call.request_id
    headers["X-KiloLine-Node"] = node
    try:
        resp, call.bytes_out = await stream_back(call.request, up, headers)
        return resp
    except ConnectionResetError:
        raise  # the client left
    except (aiohttp.ClientError, TimeoutError):
        cut_client(call.request)
        raise web.HTTPBadGateway() from None
    finally:
        up.release()


def log_access(rt: Runtime, call: Call) -> None:
    """One line per request, metadata only: never a body, a prompt or a key."""
    duration = time.monotonic() - call.started
    if call.route != "-" and call.mode == "sync":
        rt.stats.record(call.route, str(call.status), call.queue_wait if call.node != "-" else None, duration)
    if not rt.cfg.server.access_log:
        return
    rec = {
        "ts": round(time.time(), 3),
        "request_id": call.request_id,
        "method": call.request.method,
        "path": call.request.path if call.route == "-" else call.route,
        "key": call.key,
        "route": call.route,
        "node": call.node,
        "mode": call.mode,
        "status": call.status,
        "queue_wait_ms": int(call.queue_wait * 1000),
        "duration_ms": int(duration * 1000),
        "bytes": call.bytes_out,
    }
    if getattr(rt, "log_json", False):
        access_log.info(orjson.dumps(rec).decode())
    else:
        access_log.info(
            "%(request_id)s %(key)s %(route)s %(node)s %(mode)s %(status)s wait=%(queue_wait_ms)dms "
            "dur=%(duration_ms)dms bytes=%(bytes)d", rec,
        )


def build_app(rt: Runtime) -> web.Application:
    from kilolined import admin, edge, jobs_api, targets

    app = web.Application(middlewares=edge.middlewares(),
                          client_max_size=int(rt.cfg.server.max_body_mb * 1024 * 1024) + 1)
    app[RT] = rt
    admin.add_routes(app)
    jobs_api.add_routes(app)
    app.router.add_route("*", "/v1/proxy", targets.handle_proxy_endpoint)
    app.router.add_route("*", "/v1/proxy/{tail:.*}", targets.handle_proxy_endpoint)
    app.router.add_route("*", "/{tail:.*}", handle_route)
    return app
