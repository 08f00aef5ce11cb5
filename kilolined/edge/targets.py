"""The seed-compatible ``/v1/proxy`` endpoint (docs/API.md "/v1/proxy"): the client names the target.

Another way to resolve the route, nothing more: the rest of the pipeline is the same stage list.
A target is allowed only if it is a configured node's URL (the request joins that node's route
queue, pinned to that node) or matches one of the key's ``adhoc_targets`` globs (it joins the
key's ad-hoc queue for that target with ``X-Concurrency-Slot`` slots, 1–8; adhoc.py).

An ad-hoc route is made only in the admission stage (``adhoc_admission``), so a request refused
before it (auth, validation, rate, budget) leaves nothing behind; until then the stages that
read a configured route's settings are skipped for it (``unless_adhoc``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from kilolined.adapters.registry import adapter_for
from kilolined.core.auth import presented_key
from kilolined.core.hosts import parse_target, target_allowed
from kilolined.modes.call import Call
from kilolined.ops.adhoc import ADHOC_MAX_SLOTS, is_adhoc, route_name
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Rejected
from kilolined.wire.proxy import client_ip, peer_trusted

if TYPE_CHECKING:
    from kilolined.edge.context import Gateway

#: request storage: (target, slots) of an ad-hoc request, for its admission stage
_WANT: web.RequestKey[tuple[str, int]] = web.RequestKey("adhoc_target", tuple)

Stage = Callable[["Gateway", Call], "Awaitable[web.StreamResponse | None] | web.StreamResponse | None"]


class HasRuntime(Protocol):
    rt: Runtime


def parse_slots(raw: str | None) -> int | None:
    try:
        slots = int(raw if raw is not None else "1")
    except ValueError:
        return None
    return slots if 1 <= slots <= ADHOC_MAX_SLOTS else None


def resolve_target(gw: HasRuntime, call: Call) -> web.StreamResponse | None:
    """``X-Target-Host`` → (route, pinned node) or the key's ad-hoc route; always needs a key."""
    rt = gw.rt
    request = call.request
    call.principal = principal = rt.keys.lookup(presented_key(request))
    if principal is None:
        return call.error(401, "unauthorized", "missing or unknown API key")
    target = parse_target(request.headers.get("X-Target-Host", ""))
    if target is None:
        return call.error(400, "bad_request", "X-Target-Host must be scheme://host:port")
    call.tail = request.rel_url.raw_path.removeprefix("/v1/proxy") or "/"
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
        call.route_name, call.pinned_node = owners[0]
        call.kind = rt.cfg.routes[call.route_name].kind
        call.adapter = adapter_for(call.kind)
    elif target_allowed(principal.cfg.adhoc_targets, target):
        slots = parse_slots(request.headers.get("X-Concurrency-Slot"))
        if slots is None:
            return call.error(400, "bad_request", f"X-Concurrency-Slot must be an integer 1–{ADHOC_MAX_SLOTS}")
        # Named, not made: the route exists only once the request is admitted (adhoc_admission).
        call.route_name = route_name(principal.key_id, target)
        request[_WANT] = (target, slots)
        # What `authenticate` does for a configured route (skipped here: it reads the route).
        call.client_ip = client_ip(request, rt.cfg.server.trusted_proxies)
        call.trusted_peer = peer_trusted(request, rt.cfg.server.trusted_proxies)
        call.subject = call.key = principal.key_id
    else:
        return call.error(403, "forbidden", "target not allowed: not a configured node nor in adhoc_targets")
    call.route = rt.route_label(call.route_name)
    return None


def unless_adhoc(stage: Stage) -> Stage:
    """The stage, skipped for an ad-hoc request (it reads a configured route's settings)."""

    def run(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | web.StreamResponse | None:
        return None if is_adhoc(call.route_name) else stage(gw, call)

    return run


def adhoc_admission(admit: Stage) -> Stage:
    """The admission stage; for an ad-hoc request it first opens the key's route for the target
    (or refuses at a cap) and closes it after, dropping it at once if nothing was admitted."""

    def stage(gw: Gateway, call: Call) -> Awaitable[web.StreamResponse | None] | web.StreamResponse | None:
        return admit(gw, call) if not is_adhoc(call.route_name) else run(gw, call)

    async def run(gw: Gateway, call: Call) -> web.StreamResponse | None:
        rt = gw.rt
        target, slots = call.request[_WANT]
        try:
            rec = rt.adhoc.open(call.key, target, slots, rt.clock())
        except Rejected as r:
            rt.metrics.rejections.labels(call.route, r.type).inc()
            return call.rejected(r)
        try:
            answer = admit(gw, call)
            return answer if answer is None or isinstance(answer, web.StreamResponse) else await answer
        finally:
            rt.adhoc.close(rec, call.ticket, rt.clock())

    return stage
