"""The aiohttp application and the request pipeline, written once as a list of stages.

    open → route → auth → mode → unqueued → [match] → limits → body → images → rewrite → model → cost → admit ─▶ runner

``[match]``: on a path that several routes share, the body is read before the limits, to pick
the route whose ``match`` holds (its limits, queue and errors are then the request's).

Each stage takes the request's ``Call`` and either fills it in and returns None (go on) or
returns the response (stop: a refusal, or an answer that needs no slot). ``/v1/proxy`` is the
same list with another way to resolve the route (``targets.resolve_target``).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from types import CoroutineType
from urllib.parse import unquote, urlencode

import orjson
from aiohttp import web

from kilolined.adapters.openai import affinity_of, wants_stream
from kilolined.adapters.registry import adapter_for
from kilolined.core import rewrite
from kilolined.core.auth import presented_key
from kilolined.core.config import GPU_WORK, RateConfig, RouteConfig
from kilolined.core.forms import AUDIO_FORM_PATHS, FormError, form_field, is_multipart
from kilolined.core.outcome import Result
from kilolined.core.page_assets import hashed_asset
from kilolined.edge import admin, jobs_api, page, targets, usage_api
from kilolined.edge import guard as edge
from kilolined.edge.connection import settle_expect
from kilolined.edge.context import GW, RT, Gateway
from kilolined.edge.images import fill_template
from kilolined.edge.models_list import is_models_list, templates_list, with_names
from kilolined.edge.page_assets import serve_page_asset
from kilolined.edge.unqueued import forward_unqueued
from kilolined.modes.anthropic_sink import AnthropicStreamSink
from kilolined.modes.call import Call
from kilolined.modes.jobs import Job
from kilolined.modes.runner import run
from kilolined.modes.sinks import StreamSink, SyncSink
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.anthropic_body import is_anthropic_path
from kilolined.scheduling.costs import CostTooLarge, UnitError, request_cost, request_units
from kilolined.scheduling.limits import Taken, Verdict, period_word, seconds_to_period_end
from kilolined.scheduling.queue import WAITING, Rejected, Ticket
from kilolined.scheduling.routing import describe, head_holds, holds, routes_serving_elsewhere
from kilolined.wire import expect
from kilolined.wire.proxy import SERVER, Exchange, client_ip, peer_trusted, request_id

log = logging.getLogger("kilolined")
access_log = logging.getLogger("kilolined.access")

MODES = ("sync", "sse", "async")
# A stage fills the Call in and returns None (go on), or returns the response (stop). Stages that
# never wait are plain functions: a coroutine per stage would cost ~1 µs each on every request;
# a plain stage may also hand back an awaitable for the rare request that needs one (to the
# pipeline, a coroutine stage is just a stage that always does).
Stage = Callable[[Gateway, Call], "Awaitable[web.StreamResponse | None] | web.StreamResponse | None"]


def unqueued(rcfg: RouteConfig, method: str, path: str) -> bool:
    gpu_work = GPU_WORK.get(rcfg.kind)
    if gpu_work is not None and (method, path) in gpu_work:
        return False
    for pat in rcfg.unqueued:
        if " " in pat:
            m, p = pat.split(" ", 1)
            if m.upper() == method and fnmatch.fnmatchcase(path, p):
                return True
        elif fnmatch.fnmatchcase(path, pat):
            return True
    return False


def mode_of(request: web.Request) -> str | None:
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


# --- the stages, in the order a request lives them ------------------------------------------------


def check_open(gw: Gateway, call: Call) -> web.StreamResponse | None:
    if gw.rt.shutting_down:
        return call.error(503, "shutting_down", "the gateway is shutting down", 5)
    return None


def resolve_path(gw: Gateway, call: Call) -> web.StreamResponse | None:
    """The longest route prefix; the rest of the raw path (an encoded "?" or "/" stays as sent)."""
    rt = gw.rt
    match = rt.router.match(call.request.rel_url.raw_path) or page.referred_route(rt.router, rt.cfg.routes,
                                                                                 call.request)
    if match is None:
        return call.error(404, "not_found", f"no route for {call.request.path}")
    names, tail = match
    redirect = page.slash_redirect(rt.cfg.routes[names[0]], call.request)
    if redirect is not None:
        return redirect
    call.route_name = names[0]
    call.kind = rt.cfg.routes[names[0]].kind  # the same for every route of a path
    if len(names) > 1 or rt.cfg.routes[names[0]].match is not None:
        # Shared path: the first route whose method/header conditions hold stands in until
        # choose_route has seen the body (same kind and auth for all: config.py checks it).
        method, headers = call.request.method, call.request.headers
        call.route_choices = tuple(n for n in names if head_holds(rt.cfg.routes[n].match, method, headers))
        if not call.route_choices:
            return no_match(gw, call)
        call.route_name = call.route_choices[0]
    call.route = call.route_name
    call.tail = tail
    rcfg = rt.cfg.routes[call.route_name]
    call.kind = rcfg.kind
    call.anthropic = rcfg.kind == "openai" and is_anthropic_path(tail)
    call.adapter = adapter_for(rcfg.kind, tail)
    return None


def authenticate(gw: Gateway, call: Call) -> web.StreamResponse | None:
    rt = gw.rt
    request = call.request
    rcfg = rt.scheduler.routes[call.route_name].cfg
    if call.principal is None and rcfg.auth == "required":
        presented = presented_key(request)
        call.principal = rt.keys.lookup(presented)
        if call.principal is None and rcfg.kind == "comfyui" and rt.keys.is_admin(presented):
            call.admin = True  # sees every key's prompts (docs/API.md "ComfyUI over several GPUs")
        elif call.principal is None:
            rt.metrics.rejections.labels(call.route, "unauthorized").inc()
            return call.error(401, "unauthorized", "missing or unknown API key")
    # On a shared path the route is known only once its body is read: choose_route checks it then.
    if call.principal is not None and call.pinned_node is None and not call.principal.may_use(call.route_name) \
            and not call.route_name.startswith("adhoc:") and not call.route_choices:
        rt.metrics.rejections.labels(call.route, "forbidden").inc()
        return call.error(403, "forbidden", f"key {call.principal.key_id!r} may not use route {call.route!r}")
    if call.principal is not None and call.route_choices and \
            not any(call.principal.may_use(n) for n in call.route_choices):
        rt.metrics.rejections.labels(call.route, "forbidden").inc()
        return call.error(403, "forbidden", f"key {call.principal.key_id!r} may use no route of {call.request.path!r}")
    call.client_ip = client_ip(request, rt.cfg.server.trusted_proxies)
    call.trusted_peer = peer_trusted(request, rt.cfg.server.trusted_proxies)
    call.subject = call.principal.key_id if call.principal else "admin" if call.admin else f"ip:{call.client_ip}"
    call.key = call.principal.key_id if call.principal else "admin" if call.admin else "-"
    return None


def choose_mode(gw: Gateway, call: Call) -> web.StreamResponse | None:
    mode = mode_of(call.request)
    if mode is None:
        return call.error(400, "bad_request", "X-KiloLine-Mode must be sync, sse or async")
    call.mode = mode
    raw_tail = call.tail
    call.tail = tail_with_query(call.request, raw_tail)
    call.unqueued_path = unquote(raw_tail) if "%" in raw_tail else raw_tail  # unquote's own shortcut, without its call
    return None


def pass_unqueued(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | None:
    """Status, list and file endpoints neither take a slot nor wait behind the queue. Returns the
    answer to await, or None (most requests: no coroutine made)."""
    if call.adapter.has_control:
        return _control_or_unqueued(gw, call)
    return _unqueued_answer(gw, call)


async def _control_or_unqueued(gw: Gateway, call: Call) -> web.StreamResponse | None:
    # Control endpoints (ComfyUI's /interrupt, POST /queue): the adapter answers them itself.
    ctl = await call.adapter.control(gw.rt, call.request, call.route_name, call.unqueued_path,
                                     None if call.admin else call.subject, call.request_id)
    if ctl is not None:
        return ctl
    answer = _unqueued_answer(gw, call)
    if answer is None and call.admin:
        return call.error(403, "forbidden", "the admin key reads and stops prompts here; it sends none")
    return None if answer is None else await answer


def _unqueued_answer(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse] | None:
    rcfg = gw.rt.scheduler.routes[call.route_name].cfg
    if call.kind == "openai" and is_models_list(call.request.method, call.unqueued_path) and \
            (call.route_choices or renames_models(gw.rt, call.route_name)):
        found = gw.rt.router.match(call.request.rel_url.raw_path)
        return with_names(gw.rt, call, found[0] if found else call.route_choices)
    if call.kind == "comfyui" and rcfg.templates and is_models_list(call.request.method, call.unqueued_path):
        return templates_list(call, list(rcfg.templates))
    if call.pinned_node is None and unqueued(rcfg, call.request.method, call.unqueued_path):
        if call.kind == "comfyui" and call.request.method in page.PAGE_METHODS and \
                (ext := hashed_asset(call.unqueued_path)) is not None:
            return serve_page_asset(gw.rt, call, rcfg, ext)  # the web UI's hashed files, held here
        return forward_unqueued(gw.rt, call, rcfg)
    return None


def no_match(gw: Gateway, call: Call) -> web.Response:
    """404 naming every route of the path and what it would have needed."""
    found = gw.rt.router.match(call.request.rel_url.raw_path)
    names = found[0] if found is not None else ()
    why = "; ".join(f"{n} ({describe(m)})" for n in names if (m := gw.rt.cfg.routes[n].match) is not None)
    return call.error(404, "not_found", f"no route for {call.request.path} matches this request: {why}")


def choose_route(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | None:
    """Among routes sharing a path, the first whose ``match`` holds (docs/CONFIG.md#routes-that-match-the-request);
    nothing to do (no coroutine) on a path of one route."""
    return _choose_route(gw, call) if call.route_choices else None


async def _choose_route(gw: Gateway, call: Call) -> web.StreamResponse | None:
    refused = read_exchange(gw, call)
    if refused is not None and not isinstance(refused, web.StreamResponse):
        refused = await refused
    if refused is not None:
        return refused
    rt, ex = gw.rt, call.exchange
    assert ex is not None
    try:
        model = call.model = doc_model(ex)
    except FormError as e:
        return call.error(400, "bad_request", str(e))
    headers = call.request.headers
    chosen = None
    for name in call.route_choices:
        rcfg = rt.scheduler.routes[name].cfg

        def units(rcfg: RouteConfig = rcfg) -> float:
            assert rcfg.cost is not None  # config.py: min_units/max_units need a cost.unit
            return request_units(rcfg.cost, rcfg.kind, ex.method, ex.tail, ex.body, headers)

        try:
            if holds(rcfg.match, ex.method, headers, rewrite.aliased(rcfg.rewrite, model), units):
                chosen = name
                break
        except CostTooLarge as e:
            return call.error(422, "exceeds_capacity", str(e))
        except UnitError as e:
            return call.error(400, "bad_request", str(e))
    if chosen is None:
        return no_match(gw, call)
    found = rt.router.match(call.request.rel_url.raw_path)
    path_routes = found[0] if found is not None else call.route_choices
    # under the name the chosen route sends it (an alias is served where the route's map points)
    served = rewrite.aliased(rt.cfg.routes[chosen].rewrite, model)
    elsewhere = routes_serving_elsewhere(served, chosen, _model_lists(rt, path_routes)) if served else []
    if model is not None and elsewhere:
        return call.error(404, "model_not_found",
                          f"model {model!r}: no node of route {chosen} (which this request matches) serves it; "
                          f"route {', '.join(elsewhere)} does, but this request does not match it")
    if call.principal is not None and not call.principal.may_use(chosen):
        rt.metrics.rejections.labels(chosen, "forbidden").inc()
        return call.error(403, "forbidden", f"key {call.principal.key_id!r} may not use route {chosen!r}")
    call.route_name = call.route = chosen
    return None


def _model_lists(rt: Runtime, routes: Sequence[str]) -> dict[str, list[list[str] | None]]:
    """Each route's nodes' model lists (declared or discovered; None for a node declaring none)."""
    nodes = rt.scheduler.nodes
    return {r: [nodes[n].models.listed(nodes[n].cfg) for n in rt.scheduler.routes[r].all_nodes if n in nodes]
            for r in routes}


def check_limits(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | web.StreamResponse | None:
    """Token bucket per (subject, route), then the key's daily request budget, taken at once by
    the limit store. Plain: only a store that waits (Redis, in cluster mode) makes it await."""
    rt = gw.rt
    principal = call.principal
    # The key's own rate, else the route's (an ad-hoc target has none).
    rate = principal.cfg.rate if principal is not None else None
    if rate is None and not call.route_name.startswith("adhoc:"):
        rate = rt.scheduler.routes[call.route_name].cfg.rate
    wall = time.time()
    if principal is None:
        taken = rt.limits.take(call.subject, call.route, rate, None, None, wall)
    else:
        taken = rt.limits.take(call.subject, call.route, rate, principal.key_id, principal.cfg.budget, wall)
    if isinstance(taken, tuple):
        return _limits_verdict(rt, call, rate, wall, taken)
    return _await_limits(rt, call, rate, wall, taken)


async def _await_limits(rt: Runtime, call: Call, rate: RateConfig | None, wall: float,
                        taken: Awaitable[Taken]) -> web.StreamResponse | None:
    return _limits_verdict(rt, call, rate, wall, await taken)


def _limits_verdict(rt: Runtime, call: Call, rate: RateConfig | None, wall: float,
                    taken: Taken) -> web.StreamResponse | None:
    verdict, spent = taken
    if verdict is not None:
        assert rate is not None  # a verdict is of the request's rate
        refused = _rate_verdict(rt, call, rate, verdict)
        if refused is not None:
            return refused
    if call.principal is None:
        return None
    if spent:
        rt.metrics.rejections.labels(call.route, "budget_exhausted").inc()
        period = call.principal.cfg.budget.period if call.principal.cfg.budget is not None else "day"
        return call.error(429, "budget_exhausted", f"{period_word(period)} budget {spent} exhausted",
                          seconds_to_period_end(period, wall))
    call.budget_taken = True
    return None


def _rate_verdict(rt: Runtime, call: Call, rate: RateConfig, v: Verdict) -> web.StreamResponse | None:
    call.headers.update({"RateLimit-Limit": str(v.limit), "RateLimit-Remaining": str(v.remaining),
                         "RateLimit-Reset": str(v.reset_sec)})
    if v.ok:
        return None
    rt.metrics.rejections.labels(call.route, "rate_limited").inc()
    return call.error(429, "rate_limited", f"rate limit of {rate.per_minute:g}/min exceeded", v.retry_after)


def read_exchange(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | web.StreamResponse | None:
    """The request body (kept for a re-queue) and the adapter's look at it; or the refusal.
    Plain when the whole body is here already (small requests arrive with their head)."""
    if call.exchange is not None:
        return None  # already read to choose among routes sharing the path
    request = call.request
    limit = int(gw.rt.cfg.server.max_body_mb * 1024 * 1024)
    content = request.content
    if request.content_length is not None and request.content_length > limit:
        return _too_large(call, limit)
    if not content.is_eof():
        expect.let_body_come(request)  # a client waiting for "100 Continue" gets it only now
        return _read_exchange(call, limit)
    body = content.read_nowait(-1)
    if len(body) > limit:
        return _too_large(call, limit)
    return _exchange(call, body)


async def _read_exchange(call: Call, limit: int) -> web.StreamResponse | None:
    """A body still arriving: taken as it comes, refused as soon as it outgrows the limit."""
    buf = bytearray()
    async for chunk in call.request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            return _too_large(call, limit)
    return _exchange(call, bytes(buf))


def _too_large(call: Call, limit: int) -> web.StreamResponse:
    resp = call.rejected(Rejected(413, "payload_too_large", f"body over {limit // (1024 * 1024)} MB"))
    resp.force_close()  # do not drain the rest of a body we refused (it may be gigabytes)
    return resp


def _exchange(call: Call, body: bytes) -> web.StreamResponse | None:
    request = call.request
    ex = Exchange(request, request.method, call.tail, body, call.request_id, call.client_ip, call.trusted_peer)
    try:
        call.adapter.prepare(ex)
    except Rejected as r:
        return call.rejected(r)
    call.exchange = ex
    return None


def doc_model(ex: Exchange) -> str | None:
    """The body's ``model`` when it is a string, read off the exchange's one parse; for a
    multipart form (OpenAI's audio endpoints), its ``model`` field. FormError: a multipart body
    that is no form."""
    doc = ex.body_doc()
    if isinstance(doc, dict):
        model = doc.get("model")
        return model if isinstance(model, str) else None
    ctype = ex.request.headers.get("Content-Type")
    if doc is None and ex.body and is_multipart(ctype):
        assert ctype is not None
        return form_field(ex.body, ctype, "model")
    return None


def renames_models(rt: Runtime, route: str) -> bool:
    """The route, or a node of it, has a rewrite: the request's model is read and may be renamed.
    Asked once per config (the route keeps the answer until its next reload)."""
    rq = rt.scheduler.routes[route]
    if rq.renames is None:
        rcfg, nodes = rq.cfg, rt.scheduler.nodes
        rq.renames = rcfg.rewrite is not None or any(
            n in nodes and nodes[n].cfg.rewrite is not None for n in (*rcfg.nodes, *rcfg.standby, *rcfg.overflow_nodes))
    return rq.renames


def rewrite_request(gw: Gateway, call: Call) -> web.StreamResponse | None:
    """The route's rewrite (docs/CONFIG.md#rewriting-requests), before the request is routed: the
    body the node gets (its node's rewrite follows at dispatch), and the model it is routed by.
    The client's name is kept for the answer. A rewritten body is checked again by the adapter
    (a rewrite that makes it invalid is 400, as the client's own would be)."""
    ex = call.exchange
    if ex is None or call.route_name.startswith("adhoc:"):
        return None
    if not renames_models(gw.rt, call.route_name):
        return None
    rw = gw.rt.scheduler.routes[call.route_name].cfg.rewrite
    try:
        asked = call.model if call.model is not None else doc_model(ex)
        new = rewrite.rewrite_body(ex.body, ex.body_doc(), ex.request.headers.get("Content-Type"), rw) if rw else None
    except FormError as e:
        return call.error(400, "bad_request", str(e))
    if new is not None:
        ex.body, ex.body_override = new, None
        try:
            call.adapter.prepare(ex)
        except Rejected as r:
            return call.rejected(Rejected(r.status, r.type, f"after the route's rewrite: {r.message}"))
    call.asked_model = asked
    call.model = rewrite.aliased(rw, asked)
    return None


def is_audio_form(ex: Exchange) -> bool:
    """A request to OpenAI's audio endpoints, whose form must name its model."""
    return ex.method == "POST" and ex.tail.split("?", 1)[0].endswith(AUDIO_FORM_PATHS)


def name_model(gw: Gateway, call: Call) -> web.StreamResponse | None:
    """The model an OpenAI request asks for, when its route has multi-model nodes
    (docs/CONFIG.md#multi-model-nodes): the scheduler sends it only where it is served. An audio
    form without a ``model`` is refused here, as OpenAI refuses it: no node could say which."""
    if call.kind != "openai" or call.model is not None or call.exchange is None:
        return None
    ex = call.exchange
    sched = gw.rt.scheduler
    rq = sched.routes[call.route_name]
    audio = is_audio_form(ex)
    if not audio and not any(n in sched.nodes and sched.nodes[n].cfg.models is not None
                                for n in (*rq.all_nodes, *rq.cfg.overflow_nodes)):
        return None
    try:
        call.model = doc_model(ex)
    except FormError as e:
        return call.error(400, "bad_request", str(e))
    if audio and call.model is None:
        return call.error(400, "bad_request", "the form has no model field: say which model transcribes it")
    return None


def price(gw: Gateway, call: Call) -> web.StreamResponse | None:
    """The request's cost on a node's capacity (docs/CONFIG.md#cost-and-capacity), read once from its body."""
    rcfg = gw.rt.scheduler.routes[call.route_name].cfg
    ex = call.exchange
    if rcfg.cost is None or ex is None:
        return None
    try:
        call.cost = request_cost(rcfg.cost, rcfg.kind, ex.method, ex.tail, ex.body, call.request.headers)
    except CostTooLarge as e:
        return call.error(422, "exceeds_capacity", str(e))
    except UnitError as e:
        return call.error(400, "bad_request", str(e))
    return None


def admit(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | web.StreamResponse | None:
    """A place in the queue, then the one runner in the request's mode. Plain: a sync request
    admitted here hands the pipeline its runner to await (no coroutine of its own around it);
    an async callback to check or a cluster grant to settle makes it a coroutine."""
    if call.mode == "async":
        return _admit_job(gw, call)
    ticket = _ticket(gw, call)
    if not isinstance(ticket, Ticket):  # (a plain class: StreamResponse's isinstance goes through ABCMeta)
        return ticket
    if gw.rt.settle is not None:  # cluster mode: Redis decides (kilolined/cluster/leases.py)
        return _settle_then_run(gw, call, ticket, None)
    return _admitted(gw, call, ticket, None)


async def _admit_job(gw: Gateway, call: Call) -> web.StreamResponse | None:
    # A refused callback must cost nothing: no queue place, no budget.
    callback, refused = await gw.jobs.check_callback(call, call.principal)
    if refused:
        return call.error(400, "bad_request", f"callback URL refused: {refused}")
    ticket = _ticket(gw, call)
    if not isinstance(ticket, Ticket):  # (a plain class: StreamResponse's isinstance goes through ABCMeta)
        return ticket
    if gw.rt.settle is not None:
        resp = await _settle_then_run(gw, call, ticket, callback)
    else:
        resp = await _admitted(gw, call, ticket, callback)
    _log_job_end(gw, call)
    return resp


def _log_job_end(gw: Gateway, call: Call) -> None:
    job = gw.jobs.jobs.get(call.headers.get("X-KiloLine-Job", "")) if call.mode == "async" else None
    if job is not None:
        # The 202's line is written now, before any wait; the job's outcome gets a line of its own
        # (built from a few strings: the request and its body are not kept for it).
        head, started = access_head(call), call.started
        if job.finished_at is not None:  # after the 202's own line, which the handler writes next
            asyncio.get_running_loop().call_soon(job_ended, gw, head, started, job)
        else:
            job.on_end = lambda j: job_ended(gw, head, started, j)


async def _answered_early(gw: Gateway, call: Call, ticket: Ticket, early: Result) -> web.StreamResponse:
    """A sync request that waits in the queue, answered now as its backend answers it
    (``Adapter.answer_early``): from here it is run as an async job, and logged as one."""
    ex = call.exchange
    assert ex is not None
    call.mode = "async"
    resp = await gw.jobs.submit(call, ticket, ex, call.principal, None, call.adapter, early=early)
    _log_job_end(gw, call)
    return resp


def _ticket(gw: Gateway, call: Call) -> Ticket | web.StreamResponse:
    """The request's ticket from the scheduler, or its refusal."""
    rt = gw.rt
    ex = call.exchange
    assert ex is not None
    principal = call.principal
    priority = principal.cfg.priority if principal else 0
    rcfg = rt.scheduler.routes[call.route_name].cfg
    # The prefix keys are computed here, once: every dispatch attempt reads them off the ticket.
    affinity = affinity_of(ex, call.route_name, rcfg, rt.scheduler.key_memo) if rcfg.affinity != "off" else None
    try:
        return rt.admit(call.route_name, call.subject, priority, pinned_node=call.pinned_node,
                        cost=call.cost or 0.0, model=call.model, affinity=affinity, body=len(ex.body))
    except Rejected as r:
        rt.metrics.rejections.labels(call.route, r.type).inc()
        return call.rejected(r)


async def _settle_then_run(gw: Gateway, call: Call, ticket: Ticket,
                           callback: str | None) -> web.StreamResponse | None:
    rt = gw.rt
    assert rt.settle is not None
    try:
        ticket = await rt.settle(ticket)
    except Rejected as r:
        rt.metrics.rejections.labels(call.route, r.type).inc()
        return call.rejected(r)
    return await _admitted(gw, call, ticket, callback)


def _admitted(gw: Gateway, call: Call, ticket: Ticket,
              callback: str | None) -> Awaitable[web.StreamResponse | None]:
    """The admitted request's runner (not yet started): the job's, or the sync one."""
    rt = gw.rt
    ex = call.exchange
    assert ex is not None
    call.budget_taken = False  # admitted: the request counts, whatever happens next
    call.ticket = ticket
    if call.mode != "sync":
        return gw.jobs.submit(call, ticket, ex, call.principal, callback, call.adapter)
    early = call.adapter.answer_early(rt, ex, ticket) if ticket.state == WAITING else None
    if early is not None:
        return _answered_early(gw, call, ticket, early)
    if call.kind == "openai" and wants_stream(ex):
        sink: SyncSink = AnthropicStreamSink(rt, call) if call.anthropic else StreamSink(rt, call)
    else:
        sink = SyncSink(rt, call)
    return run(rt, ticket, ex, call.adapter, sink, call.key_id, call.route)


PIPELINE: Sequence[Stage] = (check_open, resolve_path, authenticate, choose_mode, pass_unqueued, choose_route,
                             check_limits, read_exchange, fill_template, rewrite_request, name_model, price, admit)
# An ad-hoc target's route is made at admission only (targets.py): the stages before it that read
# a configured route's settings are skipped for it.
PROXY_PIPELINE: Sequence[Stage] = (check_open, targets.resolve_target, targets.unless_adhoc(authenticate), choose_mode,
                                   check_limits, read_exchange, targets.unless_adhoc(price),
                                   targets.adhoc_admission(admit))


def handler(gw: Gateway, stages: Sequence[Stage],
            route: str = "-") -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The request handler of one application: ``gw`` is the one its ``app[GW]`` holds (set once
    in build_app), taken here rather than looked up through the request on every request."""
    plan = tuple(stages)

    async def handle(request: web.Request) -> web.StreamResponse:
        # The edge (kilolined/edge/guard.py) inline rather than as edge.guard: one coroutine less per request.
        refused = edge.refuse(request)
        if refused is not None:
            return refused
        call = Call(request, request_id(request), time.monotonic(), route=route)
        try:
            for stage in plan:
                # None: go on. A coroutine stage, or a plain one with work to wait for, hands
                # back an awaitable.
                resp = stage(gw, call)
                if resp is None:
                    continue
                # A coroutine is told apart by its exact type first: StreamResponse is a
                # MutableMapping, so isinstance against it runs ABCMeta's Python check.
                if type(resp) is CoroutineType or not isinstance(resp, web.StreamResponse):
                    resp = await resp
                    if resp is None:
                        continue
                if resp.prepared:
                    # A stream set its Server header before its prepare(); one that failed after
                    # its 200 has set the status it would have had.
                    call.status = call.status or resp.status
                else:
                    resp.headers["Server"] = SERVER
                    call.status = resp.status
                    settle_expect(request, resp)  # refused before "100 Continue": close after it
                return resp
            raise AssertionError("the last stage always answers")
        except Exception as exc:
            answer = edge.error_answer(request, exc)
            if answer is None:
                raise
            call.status = answer.status
            settle_expect(request, answer)
            return answer
        finally:
            if call.budget_taken and call.principal is not None:
                gw.rt.limits.give_back_request(call.principal.key_id, time.time())
            log_access(gw, call)

    return handle


MAX_LOGGED_PATH = 512


def logged_path(request: web.Request) -> str:
    """The request's path as the access log shows it: as sent (still percent-encoded), never its
    query (``?token=`` of a job's events and result URLs, keys some clients put there), anything
    outside printable ASCII percent-encoded so a line cannot be forged, at most MAX_LOGGED_PATH."""
    raw = request.rel_url.raw_path
    safe = "".join(c if "!" <= c <= "~" else "".join(f"%{b:02X}" for b in c.encode("utf-8", "replace"))
                   for c in raw[:MAX_LOGGED_PATH])
    return safe + ("…" if len(raw) > MAX_LOGGED_PATH else "")


def job_ended(gw: Gateway, head: dict[str, object], started: float, job: Job) -> None:
    """The access-log line of an async job's outcome (its request's line was written at the 202):
    the same request id, method and path (``head``), the node, the wait, the size of the result
    and the status the node's answer had (``-`` for a job that ended without one: a queue
    timeout, a cancel)."""
    if not gw.rt.cfg.server.access_log:
        return
    wait = job.queue_wait
    rec: dict[str, object] = {
        "ts": round(time.time(), 3), **head, "node": job.node or "-", "mode": "async",
        "status": job.http_status or "-", "queue_wait_ms": None if wait is None else int(wait * 1000),
        "duration_ms": int((time.monotonic() - started) * 1000),
        "bytes": len(job.result.body) if job.result is not None else 0,
    }
    if job.swap is not None:
        rec["swap"] = job.swap
    rec["job"] = job.status
    write_access(gw, rec)


def log_access(gw: Gateway, call: Call) -> None:
    """One line per request, metadata only: never a body, a prompt, a key or a query string."""
    rt = gw.rt
    duration = time.monotonic() - call.started
    if call.route != "-" and call.mode == "sync":
        # GPU work is a request that was admitted (a ticket) and leased to a node; an unqueued path
        # names a node too, but holds no ticket.
        ran = call.ticket is not None and call.node != "-"
        rt.stats.record(call.route, str(call.status), call.queue_wait if ran else None, duration, ran=ran)
    if not rt.cfg.server.access_log:
        return
    wait = call.queue_wait
    rec: dict[str, object] = {
        "ts": round(time.time(), 3), **access_head(call), "node": call.node, "mode": call.mode,
        "status": call.status or "-", "queue_wait_ms": None if wait is None else int(wait * 1000),
        "duration_ms": int(duration * 1000), "bytes": call.bytes_out,
    }
    if call.cost is not None:
        rec["cost"] = round(call.cost, 3)
    if call.swap is not None:
        rec["swap"] = call.swap
    t = call.ticket
    a = t.affinity if t is not None else None
    if a is not None and a.outcome is not None:
        rec["affinity"] = a.outcome
    if t is not None and t.cached is not None:
        rec["cached"] = t.cached
    if t is not None and t.continued:
        rec["continued"] = t.continued  # its stream went on on another node (docs/API.md)
    if t is not None and t.usd is not None:
        rec["usd"] = round(t.usd, 6)  # what an overflow node's price_per_mtok made of its tokens
    write_access(gw, rec)


def access_head(call: Call) -> dict[str, object]:
    """What a request's access-log lines share: its id, method, path (no query), key and route."""
    return {"request_id": call.request_id, "method": call.request.method, "path": logged_path(call.request),
            "key": call.key, "route": call.route}


def write_access(gw: Gateway, rec: dict[str, object]) -> None:
    if gw.log_json:
        access_log.info(orjson.dumps(rec).decode())
        return
    swap = rec.get("swap")
    access_log.info(
        "%(request_id)s %(method)s %(path)s %(key)s %(route)s %(node)s %(mode)s %(status)s "
        + ("wait=-" if rec["queue_wait_ms"] is None else "wait=%(queue_wait_ms)dms")
        + " dur=%(duration_ms)dms bytes=%(bytes)d" + (" cost=%(cost)g" if "cost" in rec else "")
        + ("" if swap is None else " swap=true" if swap else " swap=false")
        + (" affinity=%(affinity)s" if "affinity" in rec else "")
        + (" cached=%(cached)d" if "cached" in rec else "")
        + (" continued=%(continued)d" if "continued" in rec else "")
        + (" usd=%(usd)g" if "usd" in rec else "")
        + (" job=%(job)s" if "job" in rec else ""),
        rec,
    )


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=int(gw.rt.cfg.server.max_body_mb * 1024 * 1024) + 1)
    app[GW] = gw
    app[RT] = gw.rt
    admin.add_routes(app)
    jobs_api.add_routes(app)
    usage_api.add_routes(app)
    proxy = handler(gw, PROXY_PIPELINE, route="proxy")
    # "100 Continue" is the pipeline's to say, once auth and limits passed (kilolined/wire/expect.py)
    app.router.add_route("*", "/v1/proxy", proxy, expect_handler=expect.defer)
    app.router.add_route("*", "/v1/proxy/{tail:.*}", proxy, expect_handler=expect.defer)
    app.router.add_route("*", "/{tail:.*}", handler(gw, PIPELINE), expect_handler=expect.defer)
    return app
