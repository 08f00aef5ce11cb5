"""Operator endpoints (docs/API.md#admin-endpoints): health, readiness, metrics, state, events,
reload, drain, dashboard."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from importlib import resources

import orjson
from aiohttp import web

from kilolined.core.auth import presented_key
from kilolined.core.config import NOTIFY_EVENTS
from kilolined.core.errors import error_response
from kilolined.edge.context import RT
from kilolined.edge.guard import guard
from kilolined.ops.history import History
from kilolined.ops.reload import reload_from_file
from kilolined.ops.runtime import Runtime
from kilolined.ops.views import HISTORY_SERIES, route_series
from kilolined.ops.views import health as health_reasons
from kilolined.ops.views import readiness as readiness_reasons
from kilolined.ops.views import state as state_view
from kilolined.wire.proxy import SERVER

SESSION_TTL_SEC = 3600  # short-lived: the page asks for a new one with the stored key
HISTORY_SPAN_SEC = 600  # the dashboard chart's window
HISTORY_STEP_SEC = 1.0
HISTORY_SAMPLE_SEC = 0.25  # several looks per step: a bucket keeps the peak, so short bursts show
HISTORY: web.AppKey[History] = web.AppKey("history", History)


def _rt(request: web.Request) -> Runtime:
    return request.app[RT]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def is_admin(request: web.Request) -> bool:
    return _rt(request).keys.is_admin(presented_key(request))


def _denied() -> web.Response:
    return error_response(401, "unauthorized", "admin key required")


async def healthz(request: web.Request) -> web.Response:
    # Alive either way (200); "degraded": a cluster gateway that has not reached Redis since it
    # started, whose requests wait for it (docs/CLUSTER.md).
    cluster = _rt(request).cluster
    return _json({"status": "degraded" if cluster is not None and not cluster.reached else "ok"})


async def readyz(request: web.Request) -> web.Response:
    reasons = readiness_reasons(_rt(request))
    return _json({"status": "ready" if not reasons else "not_ready", "reasons": reasons}, 200 if not reasons else 503)


async def health(request: web.Request) -> web.Response:
    # Where inference clients and benchmarks look (vLLM, SGLang, TGI and llama.cpp answer it): 200
    # while some route can serve, else 503. No key, like /healthz.
    reasons = health_reasons(_rt(request))
    return _json({"status": "ok"} if not reasons else {"status": "unavailable", "reasons": reasons},
                 200 if not reasons else 503)


async def metrics(request: web.Request) -> web.Response:
    rt = _rt(request)
    if not rt.cfg.admin.public_metrics and not is_admin(request):
        return _denied()
    from prometheus_client import CONTENT_TYPE_LATEST

    return web.Response(body=rt.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def state(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _denied()
    return _json(state_view(_rt(request)))


async def history(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _denied()
    return _json(request.app[HISTORY].snapshot())


async def reload(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _denied()
    rt = _rt(request)
    errors = await reload_from_file(rt, reason="admin API")
    if errors:
        return _json({"ok": False, "errors": errors}, 422)
    return _json({"ok": True, "version": rt.version})


async def drain(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _denied()
    rt = _rt(request)
    name = request.match_info["name"]
    ns = rt.scheduler.nodes.get(name)
    if ns is None or ns.retired:
        return error_response(404, "not_found", f"no node {name!r}")
    rt.node_events(ns, ns.drain(request.match_info["op"] == "drain"))  # cluster mode: on every gateway
    rt.feed.publish("drain" if ns.drained else "undrain", node=name,
                    text=f"{'⏸' if ns.drained else '▶'} {name} {'drained' if ns.drained else 'undrained'}")
    rt.wake()
    return _json({"node": name, "drained": ns.drained, "inflight": rt.scheduler.node_inflight.get(name, 0)})


# --- dashboard session tokens: the event stream must never carry the admin key in a URL ---------


async def new_session(request: web.Request) -> web.Response:
    if not is_admin(request):
        return _denied()
    rt = _rt(request)
    sessions = rt.admin_sessions
    now = time.monotonic()
    for t, exp in list(sessions.items()):
        if exp < now:
            del sessions[t]
    token = secrets.token_urlsafe(24)
    sessions[token] = now + SESSION_TTL_SEC
    return _json({"session": token, "expires_in": SESSION_TTL_SEC})


def _session_ok(request: web.Request) -> bool:
    token = request.query.get("session")
    if not token:
        return is_admin(request)
    exp = _rt(request).admin_sessions.get(token)
    return exp is not None and exp > time.monotonic()


async def events(request: web.Request) -> web.StreamResponse:
    """SSE of state changes, plus a state snapshot at most twice a second while anything moves."""
    if not _session_ok(request):
        return _denied()
    rt = _rt(request)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "Server": SERVER})
    await resp.prepare(request)
    q = rt.feed.subscribe()
    try:
        await resp.write(b"retry: 3000\n\n")
        for ev in list(rt.feed.recent)[-50:]:
            await resp.write(b"event: " + ev["kind"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n")
        # The chart's past, so a page opened after a burst still shows it.
        await resp.write(b"event: history\ndata: " + orjson.dumps(request.app[HISTORY].snapshot()) + b"\n\n")
        last_state = b""
        last_beat = time.monotonic()
        while not rt.shutting_down:  # an open dashboard must not hold a shutdown for its grace period
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    ev = await q.get()
                    await resp.write(b"event: " + ev["kind"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n")
                    continue
            st = orjson.dumps(state_view(rt))
            if st != last_state:
                last_state = st
                await resp.write(b"event: state\ndata: " + st + b"\n\n")
                last_beat = time.monotonic()
            elif time.monotonic() - last_beat > rt.cfg.server.heartbeat_sec:
                await resp.write(b": ping\n\n")
                last_beat = time.monotonic()
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    finally:
        rt.feed.unsubscribe(q)
    return resp


#: what the feed publishes besides the notify events: the page listens for each by name (an
#: EventSource hears only the names it asks for, so a list kept by hand in the page dropped every
#: kind added since, the fleet's among them)
FEED_ONLY_KINDS = ("reload", "drain", "undrain", "message")
_FEED_KINDS_MARK = b'<script type="application/json" id="feed-kinds">[]</script>'


def feed_kinds() -> list[str]:
    return [*NOTIFY_EVENTS, *FEED_ONLY_KINDS]


async def dashboard(request: web.Request) -> web.Response:
    html = resources.files("kilolined.edge.web").joinpath("dashboard.html").read_bytes()
    html = html.replace(_FEED_KINDS_MARK, _FEED_KINDS_MARK.replace(b"[]", orjson.dumps(feed_kinds())))
    return web.Response(body=html, content_type="text/html", headers={"Cache-Control": "no-cache"})


async def _sample_history(rt: Runtime, hist: History) -> None:
    while True:
        hist.record(route_series(rt))
        await asyncio.sleep(HISTORY_SAMPLE_SEC)


async def _history_sampler(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_sample_history(app[RT], app[HISTORY]), name="kiloline-history")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def forget_gateway(request: web.Request) -> web.Response:
    """A lost gateway is gone for good: its share, reserved in Redis, is free (docs/CLUSTER.md)."""
    if not is_admin(request):
        return _denied()
    cluster, gid = _rt(request).cluster, request.match_info["gateway_id"]
    if cluster is None:
        return error_response(404, "not_found", "not in cluster mode")
    if not cluster.redis_up:
        return error_response(503, "unavailable", "Redis is unreachable: nothing can be forgotten now")
    verdict = await cluster.forget(gid)
    if verdict == "alive":
        return error_response(409, "conflict", f"gateway {gid} is alive: it holds only what it runs")
    if verdict != "forgotten":
        return error_response(404, "not_found", f"no lost gateway {gid}")
    return _json({"forgotten": gid})


def add_routes(app: web.Application) -> None:
    # each handler behind the edge: raw-path check, JSON errors (kilolined/edge/guard.py)
    app[HISTORY] = History(HISTORY_SERIES, span_sec=HISTORY_SPAN_SEC, step_sec=HISTORY_STEP_SEC,
                           clock=app[RT].clock)
    app.cleanup_ctx.append(_history_sampler)
    r = app.router
    r.add_get("/healthz", guard(healthz))
    r.add_get("/readyz", guard(readyz))
    r.add_get("/health", guard(health))
    r.add_get("/metrics", guard(metrics))
    r.add_get("/admin/state", guard(state))
    r.add_get("/admin/events", guard(events))
    r.add_get("/admin/history", guard(history))
    r.add_post("/admin/session", guard(new_session))
    r.add_post("/admin/reload", guard(reload))
    r.add_post(r"/admin/nodes/{name}/{op:drain|undrain}", guard(drain))
    r.add_post("/admin/cluster/forget/{gateway_id}", guard(forget_gateway))
    r.add_get("/dashboard", guard(dashboard))
    r.add_get("/dashboard/", guard(dashboard))
