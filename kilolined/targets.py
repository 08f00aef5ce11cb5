"""The seed-compatible ``/v1/proxy`` endpoint (docs/API.md "/v1/proxy"): the client names the target.

Another way to resolve the route, nothing more: the rest of the pipeline is the same stage list.
A target is allowed only if it is a configured node's URL (the request joins that node's route
queue, pinned to that node) or matches one of the key's ``adhoc_targets`` globs (it joins an
ad-hoc queue for that target with ``X-Concurrency-Slot`` slots, 1–8).
"""

from __future__ import annotations

import re
from typing import Protocol

from aiohttp import web

from kilolined.adapters.registry import adapter_for
from kilolined.auth import presented_key
from kilolined.call import Call
from kilolined.runtime import Runtime

_TARGET = re.compile(r"https?://[A-Za-z0-9.\-\[\]]+(:[0-9]{1,5})?")


class HasRuntime(Protocol):
    rt: Runtime


def resolve_target(gw: HasRuntime, call: Call) -> web.StreamResponse | None:
    """``X-Target-Host`` → (route, pinned node) or an ad-hoc route; always needs a key."""
    rt = gw.rt
    request = call.request
    call.principal = principal = rt.keys.lookup(presented_key(request))
    if principal is None:
        return call.error(401, "unauthorized", "missing or unknown API key")
    target = request.headers.get("X-Target-Host", "").strip().rstrip("/")
    m = _TARGET.fullmatch(target)
    if m is None or (m.group(1) is not None and not 0 < int(m.group(1)[1:]) < 65536):
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
    elif principal.may_target(target):
        try:
            slots = int(request.headers.get("X-Concurrency-Slot", "1"))
        except ValueError:
            return call.error(400, "bad_request", "X-Concurrency-Slot must be an integer 1–8")
        if not 1 <= slots <= 8:
            return call.error(400, "bad_request", "X-Concurrency-Slot must be an integer 1–8")
        call.route_name = rt.adhoc_route(target, slots)
    else:
        return call.error(403, "forbidden", "target not allowed: not a configured node nor in adhoc_targets")
    call.route = rt.route_label(call.route_name)
    return None
