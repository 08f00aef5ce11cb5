"""Sync ``"stream": true`` requests on openai routes (SPEC §4.1).

The client gets ``200 text/event-stream`` at once and an SSE comment every ``heartbeat_sec``
while it waits (``: queued position=N est_wait_sec=S``), so neither it nor a proxy in between
times out on a long queue; then the node's stream verbatim. A failure after the 200 is told the
way OpenAI clients understand: ``data: {"error": …}`` then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from kilolined.forward import HttpAttempt, with_retries
from kilolined.proxy import UpstreamFailed
from kilolined.queue import WAITING, Rejected, Ticket

if TYPE_CHECKING:
    from kilolined.app import Call
    from kilolined.proxy import Exchange
    from kilolined.runtime import Runtime


def error_event(type_: str, message: str) -> bytes:
    # OpenAI's shape: code is a string (or null); SDKs raise APIError on this event.
    err = {"error": {"message": message, "type": type_, "code": type_}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"


def _node_message(body: bytes, status: int) -> tuple[str, str]:
    """The node's own error message, whichever backend's shape it has."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"node answered HTTP {status}", "upstream_error"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"]), str(err.get("type") or "upstream_error")
        if isinstance(err, str):
            return err, "upstream_error"
    return f"node answered HTTP {status}", "upstream_error"


async def run_sync_stream(rt: Runtime, call: Call, ticket: Ticket, ex: Exchange) -> web.StreamResponse:
    from kilolined.app import SyncHooks

    label = rt._route_label(ticket.route)
    resp = web.StreamResponse(status=200, headers={
        **call.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", "X-Request-Id": call.request_id,
    })
    await resp.prepare(call.request)
    call.status = 200
    hooks = SyncHooks(rt, call, label)
    waiter = asyncio.ensure_future(with_retries(rt, ticket, HttpAttempt(rt, ex), hooks))
    try:
        while True:
            if ticket.state == WAITING:
                now = rt.clock()
                pos = rt.scheduler.position(ticket, now)
                est = rt.scheduler.est_wait(rt.scheduler.routes[ticket.route], pos or 0, now)
                # JSON spelling (null, not None), as in the sse events.
                await resp.write(b": queued position=%s est_wait_sec=%s\n\n" % (orjson.dumps(pos), orjson.dumps(est)))
            done, _ = await asyncio.wait({waiter}, timeout=rt.cfg.server.heartbeat_sec)
            if done:
                break
            if ticket.state != WAITING:
                await resp.write(b": running\n\n")
    except BaseException:
        # The client left (or we are cancelled) while queued. The waiter may have got its lease
        # and the node's answer in the same moment: give both back, or the slot would be lost.
        waiter.cancel()
        with contextlib.suppress(BaseException):
            lease, up = await waiter
            up.release()
            rt.release(lease, ok=None)
        raise
    try:
        lease, up = waiter.result()
    except Rejected as r:
        await resp.write(error_event(r.type, r.message))
        return resp
    except UpstreamFailed as e:
        rt.metrics.requests.labels(label, "timeout" if e.timeout else "upstream_error").inc()
        kind = "upstream_timeout" if e.timeout else "upstream_error"
        await resp.write(error_event(kind, f"node {call.node} failed: {e.reason}"))
        return resp
    key = call.key if call.key != "-" else None
    obs = call.adapter.observer(rt, ex, label, key, hooks.dispatched_at)
    ok: bool | None = None
    try:
        if up.status != 200 or "text/event-stream" not in up.headers.get("Content-Type", ""):
            body = await up.read()
            if up.status == 200:
                # A node that ignored "stream": pass its JSON through as one data line.
                await resp.write(b"data: " + body.strip() + b"\n\ndata: [DONE]\n\n")
                if obs is not None:
                    obs.feed(body)
                ok = True
            else:
                message, type_ = _node_message(body, up.status)
                await resp.write(error_event(type_, message))
                ok = up.status < 500
        else:
            async for chunk in up.content.iter_any():
                if obs is not None:
                    obs.feed(chunk)
                await resp.write(chunk)
                call.bytes_out += len(chunk)
            ok = True
        rt.metrics.requests.labels(label, "ok" if ok else "upstream_error").inc()
    except ConnectionResetError:
        rt.metrics.requests.labels(label, "client_gone").inc()
        raise
    except (aiohttp.ClientError, TimeoutError):
        ok = False
        rt.node_failure(lease.node, "connection lost mid-stream", lease.trial)
        rt.metrics.requests.labels(label, "upstream_error").inc()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write(error_event("upstream_error", "the node failed mid-stream"))
    finally:
        up.release()
        if obs is not None:
            obs.done(bool(ok))
        rt.metrics.upstream.labels(label, lease.node).observe(rt.clock() - hooks.dispatched_at)
        rt.release(lease, ok=ok, key=key)
    await resp.write_eof()
    return resp
