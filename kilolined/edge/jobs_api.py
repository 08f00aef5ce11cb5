"""The Jobs API (docs/API.md#jobs-api): status, events (with replay), result, files, cancel.

A job is visible to the key that created it, or to anyone holding its ``access_token``
(``?token=``, so a browser EventSource can follow it). Everyone else gets 404, not 403: a job id
must not be probeable.
"""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.comfy_store import job_file, job_file_name
from kilolined.core.errors import error_response
from kilolined.edge.context import GW
from kilolined.edge.guard import guard
from kilolined.modes.jobs import TERMINAL, Job, Jobs
from kilolined.ops.runtime import Runtime
from kilolined.wire.proxy import request_id, response_headers, stream_back


def _rt(request: web.Request) -> Runtime:
    return request.app[GW].rt


def _jobs(request: web.Request) -> Jobs:
    return request.app[GW].jobs


async def _job(request: web.Request) -> Job | None:
    # Any gateway of a cluster answers for every job (docs/CLUSTER.md#jobs).
    return await _jobs(request).find_any(request, request.match_info["job_id"])


def _not_found(request: web.Request) -> web.Response:
    return error_response(404, "not_found", "no such job", request_id=request_id(request))


def _view(request: web.Request, job: Job) -> dict[str, object]:
    return _jobs(request).view(job)


async def status(request: web.Request) -> web.Response:
    job = await _job(request)
    if job is None:
        return _not_found(request)
    return web.Response(body=orjson.dumps(_view(request, job)), content_type="application/json")


async def events(request: web.Request) -> web.StreamResponse:
    job = await _job(request)
    if job is None:
        return _not_found(request)
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0"
    try:
        after = int(raw)
    except ValueError:
        return error_response(400, "bad_request", "Last-Event-ID must be an event id",
                              request_id=request_id(request))
    return await _jobs(request).stream(request, job, after, {"X-Request-Id": request_id(request)})


async def result(request: web.Request) -> web.Response:
    job = await _job(request)
    if job is None:
        return _not_found(request)
    if job.status not in TERMINAL:
        est = _view(request, job).get("est_wait_sec")  # seconds, or None when nothing is known
        return error_response(425, "not_ready", f"job is {job.status}", request_id=request_id(request),
                              retry_after=max(1.0, est if isinstance(est, int | float) else 1.0))
    if job.result is None:
        return error_response(404, "not_found", "no result (failed, cancelled, or expired)",
                              request_id=request_id(request))
    res = job.result
    return web.Response(status=res.http_status, body=res.body, headers={"Content-Type": res.content_type})


async def file(request: web.Request) -> web.StreamResponse:
    """ComfyUI outputs: stream /view from the node that rendered the image, never revealing it."""
    job = await _job(request)
    if job is None or job.result is None:
        return _not_found(request)
    files = job.result.files
    n = request.match_info["n"]
    if not n.isdigit() or int(n) >= len(files):  # "-1" is not the last file
        return error_response(404, "not_found", "no such file", request_id=request_id(request))
    node, query = files[int(n)]
    rt = _rt(request)
    # Copied off the node: found by the name the result gave it when another gateway copied it.
    stored = await job_file(rt, request, job.route, node, query, request_id(request),
                            named=job_file_name(job.result.body, int(n)))
    if stored is not None:
        return stored
    ns = rt.scheduler.nodes.get(node)
    if ns is None:
        return error_response(502, "upstream_error", f"node {node} is gone", request_id=request_id(request))
    try:
        async with rt.session(node).get(ns.cfg.url + "/view?" + query, headers=ns.cfg.headers,
                                        timeout=aiohttp.ClientTimeout(total=60)) as up:
            resp, _ = await stream_back(request, up, response_headers(up, ns.cfg.url, "/"))
            return resp
    except ConnectionResetError:
        raise  # the client left
    except (aiohttp.ClientError, TimeoutError):
        return error_response(502, "upstream_error", f"node {node} did not serve the file",
                              request_id=request_id(request))


async def cancel(request: web.Request) -> web.Response:
    job = await _job(request)
    if job is None:
        return _not_found(request)
    job = await _jobs(request).cancel_any(job)
    return web.Response(body=orjson.dumps(_view(request, job)), content_type="application/json")


def add_routes(app: web.Application) -> None:
    # each handler behind the edge: raw-path check, JSON errors (kilolined/edge/guard.py)
    r = app.router
    r.add_get("/v1/jobs/{job_id}", guard(status))
    r.add_delete("/v1/jobs/{job_id}", guard(cancel))
    r.add_get("/v1/jobs/{job_id}/events", guard(events))
    r.add_get("/v1/jobs/{job_id}/result", guard(result))
    r.add_get("/v1/jobs/{job_id}/files/{n}", guard(file))
