"""The seed-compatible ``/v1/proxy`` endpoint (SPEC §4.6): the client names the target host.

A target is allowed only if it is a configured node's URL (the request joins that node's
route queue, pinned to that node) or matches one of the key's ``adhoc_targets`` globs (it joins
an ad-hoc queue for that target with ``X-Concurrency-Slot`` slots, 1–8).
"""

from __future__ import annotations

import re
import time

from aiohttp import web

from kilolined.adapters import adapter_for
from kilolined.app import RT, Call, admit_and_run, check_limits, choose_mode, log_access, read_exchange, tail_with_query
from kilolined.auth import presented_key
from kilolined.proxy import client_ip, request_id

_TARGET = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


async def handle_proxy_endpoint(request: web.Request) -> web.StreamResponse:
    rt = request.app[RT]
    call = Call(request, request_id(request), time.monotonic(), route="proxy")
    try:
        resp = await _proxy(call)
        call.status = resp.status
        return resp
    finally:
        log_access(rt, call)


async def _proxy(call: Call) -> web.StreamResponse:
    request = call.request
    rt = request.app[RT]
    if rt.shutting_down:
        return call.error(503, "shutting_down", "the gateway is shutting down", 5)
    principal = rt.keys.lookup(presented_key(request))
    if principal is None:
        return call.error(401, "unauthorized", "missing or unknown API key")
    call.key = principal.key_id
    target = request.headers.get("X-Target-Host", "").strip().rstrip("/")
    if not _TARGET.fullmatch(target):
        return call.error(400, "bad_request", "X-Target-Host must be scheme://host:port")
    mode = choose_mode(request)
    if mode is None:
        return call.error(400, "bad_request", "X-KiloLine-Mode must be sync, sse or async")
    call.mode = mode
    tail = tail_with_query(request, request.rel_url.raw_path.removeprefix("/v1/proxy") or "/")
    pinned: str | None = None
    route: str | None = None
    owners = [
        (rn, n)
        for rn, rcfg in rt.cfg.routes.items()
        for n in (*rcfg.nodes, *rcfg.standby)
        if rt.cfg.nodes[n].url == target
    ]
    if owners:
        wanted = request.headers.get("X-KiloLine-Route")
        if wanted:
            owners = [o for o in owners if o[0] == wanted]
        owners = [o for o in owners if principal.may_use(o[0])]
        if not owners:
            return call.error(403, "forbidden", "target not allowed for this key")
        route, pinned = owners[0]
    elif principal.may_target(target):
        try:
            slots = int(request.headers.get("X-Concurrency-Slot", "1"))
        except ValueError:
            return call.error(400, "bad_request", "X-Concurrency-Slot must be an integer 1–8")
        if not 1 <= slots <= 8:
            return call.error(400, "bad_request", "X-Concurrency-Slot must be an integer 1–8")
        route = rt.adhoc_route(target, slots)
    else:
        return call.error(403, "forbidden", "target not allowed: not a configured node nor in adhoc_targets")
    call.route = rt._route_label(route)
    route_rate = None
    if pinned is not None:
        call.kind = rt.cfg.routes[route].kind
        call.adapter = adapter_for(call.kind)
        route_rate = rt.cfg.routes[route].rate
    refused = check_limits(rt, call, principal, principal.key_id, route_rate)
    if refused is not None:
        return refused
    ex = await read_exchange(rt, call, tail, client_ip(request, rt.cfg.server.trusted_proxies))
    if isinstance(ex, web.Response):
        return ex
    return await admit_and_run(rt, call, route, ex, principal, principal.cfg.priority, pinned_node=pinned)
