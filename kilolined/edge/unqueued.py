"""Requests on ``unqueued_paths``: forwarded at once, without a slot (status, history, files).

They need the key but skip rate limits and budgets (status pages poll often) and never wait.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kilolined.core.config import RouteConfig
from kilolined.core.outcome import Failure
from kilolined.modes.call import Call
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Rejected
from kilolined.wire import expect
from kilolined.wire.proxy import Exchange, UpstreamFailed, cut_client, open_upstream, response_headers, stream_back
from kilolined.wire.wsproxy import proxy_websocket


async def forward_unqueued(rt: Runtime, call: Call, rcfg: RouteConfig) -> web.StreamResponse:
    """Pass-through without a slot, to the first node that is up (primaries first)."""
    now = rt.clock()
    rq = rt.scheduler.routes[call.route_name]
    usable = rt.scheduler.usable(rq, now) or rq.all_nodes
    node = usable[0]
    ns = rt.scheduler.nodes[node]
    call.node = node
    tail = call.tail
    if call.request.headers.get("Upgrade", "").lower() == "websocket":
        try:
            return await proxy_websocket(
                call.request, rt.session(node), ns.cfg.url + tail, {"X-Request-Id": call.request_id, **ns.cfg.headers},
                response_headers={"X-Request-Id": call.request_id, "X-KiloLine-Node": node})
        except UpstreamFailed as e:
            return _failed(call, node, e)
    if call.request.can_read_body:
        expect.let_body_come(call.request)
        body = await call.request.read()
    else:
        body = b""
    ex = Exchange(call.request, call.request.method, tail, body, call.request_id, call.client_ip,
                  call.trusted_peer)
    try:
        call.adapter.prepare(ex)  # e.g. comfyui drops Origin (ComfyUI answers 403 otherwise)
    except Rejected as r:
        return call.rejected(r)
    try:
        up = await open_upstream(rt.pool(node), ex, ns.cfg.url, ns.cfg.headers, rcfg.request_timeout_sec)
    except UpstreamFailed as e:
        return _failed(call, node, e)
    headers = response_headers(up, ns.cfg.url, rcfg.path if rcfg.strips_path else "/")
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


def _failed(call: Call, node: str, e: UpstreamFailed) -> web.Response:
    f = Failure.upstream(f"node {node} did not answer in time" if e.timeout else f"node {node} failed: {e.reason}",
                         e.timeout)
    return call.error(f.http_status or 502, f.type, f.message)
