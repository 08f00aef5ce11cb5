"""Read-only views of the Runtime for operators: the /admin/state snapshot and readiness.

Kept apart from runtime.py so the request path and the operator's views change independently.
Plain functions over the Runtime's scheduler, stats and config; nothing here mutates state.
"""

from __future__ import annotations

from typing import Any

from kilolined.ops.runtime import Runtime
from kilolined.ops.stats import machines
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import RouteQueue, Scheduler


def route_snapshot(sched: Scheduler, rq: RouteQueue, now: float) -> dict[str, Any]:
    return {
        "queue_depth": sched.depth(rq),
        "inflight": sum(rq.inflight.values()),
        "slots": sched.live_slots(rq, now),
        "waiting_by_key": sched.waiting_by_key(rq),
        "est_wait_sec": sched.est_wait(rq, sched.depth(rq) + 1, now) if sched.depth(rq) else
        sched.est_wait(rq, 0, now),
        "active_nodes": sched.usable(rq, now),
        "mode": rq.mode,
        "kind": rq.cfg.kind,
        "path": rq.cfg.path,
        "max_concurrency": rq.cfg.max_concurrency,
        "nodes": list(rq.cfg.nodes),
        "standby": list(rq.cfg.standby),
        "capacity_used": round(rq.capacity_used, 3),
        # Affinity (docs/CONFIG.md#affinity): the keys of the prefix index per node (every route's).
        "affinity": rq.cfg.affinity,
        "index_keys": {n: sched.index_keys(n) for n in rq.all_nodes},
    }


def routes_by_node(sched: Scheduler) -> dict[str, list[RouteQueue]]:
    """Each node's live routes, from one pass over the routes: a snapshot asks it of every node,
    and a pass over every route per node is quadratic (seconds for thousands of routes, with the
    event loop and /healthz blocked meanwhile)."""
    out: dict[str, list[RouteQueue]] = {}
    for rq in sched.routes.values():
        if not rq.retired:
            for n in dict.fromkeys(rq.all_nodes):  # a node named twice in a route counts once
                out.setdefault(n, []).append(rq)
    return out


def node_slots(ns: NodeState, routes: list[RouteQueue], now: float) -> tuple[int, int]:
    """(usable now, configured) slots of a node summed over its ``routes``; slow start makes the
    first smaller than the second for a while after a recovery."""
    slots = full = 0
    for rq in routes:
        # effective() first: it is what ends a finished slow start.
        slots += ns.effective(rq.cfg.max_concurrency, now)
        full += rq.cfg.max_concurrency
    cap = ns.cfg.max_concurrency
    if cap is not None:
        slots = min(slots, ns.effective(cap, now))
        full = min(full, cap)
    return slots, full


def cards_snapshot(sched: Scheduler) -> dict[str, Any]:
    """``cards`` of /admin/state (docs/CONFIG.md#cards): each card's limits, its nodes, and what the
    leases on them hold now."""
    load = sched.cards
    return {c: {"max_concurrency": cfg.max_concurrency, "capacity": cfg.capacity,
                "inflight": load.inflight.get(c, 0), "capacity_used": round(load.used.get(c, 0.0), 3),
                "nodes": [n for n, ns in sched.nodes.items() if ns.cfg.card == c and not ns.retired]}
            for c, cfg in load.cfg.items()}


def slow_start_left(ns: NodeState, now: float) -> float | None:
    """Seconds until the node's slow start ends; None when it is not in one."""
    if ns.recovered_at is None:
        return None
    left = ns.recovered_at + ns.breaker_cfg.slow_start_sec - now
    return left if left > 0 else None


def state(rt: Runtime) -> dict[str, Any]:
    """The /admin/state snapshot (docs/API.md), plus the dashboard's stats and cost."""
    now = rt.clock()
    sched = rt.scheduler
    routes = {n: route_snapshot(sched, rq, now) for n, rq in sched.routes.items()
              if not n.startswith("adhoc:") and not rq.retired}
    prompt_tokens = rt.metrics.prompt_tokens_by_route()
    for n, r in routes.items():
        # What its nodes reported of the prompts (the dashboard's cached share); zeros until one did.
        cached, total = prompt_tokens.get(n, (0.0, 0.0))
        r["prompt_tokens"] = {"cached": int(cached), "total": int(total)}
        # Streams that survive their node (docs/API.md): continued on another node since start.
        r["continue_streams"] = sched.routes[n].cfg.continue_streams
        r["continuations"] = int(rt.metrics.continuations.labels(rt.route_label(n)).value)
        rcfg = rt.cfg.routes.get(n)
        if rcfg is not None and rcfg.kind == "comfyui":
            r["comfy_files"] = {"files": 0, "bytes": 0}  # the route's held inputs and outputs
            r["page_assets"] = {"files": 0, "bytes": 0}  # its web UI's hashed files, held (page_assets.py)
    source = rt.metrics.comfy_files_source
    for n, files, held in source() if source is not None else ():
        if n in routes:
            routes[n]["comfy_files"] = {"files": files, "bytes": held}
    for n, files, held in rt.page_assets.by_route():
        if "page_assets" in routes.get(n, {}):
            routes[n]["page_assets"] = {"files": files, "bytes": held}
    nodes: dict[str, Any] = {}
    by_node = routes_by_node(sched)
    for n, ns in sched.nodes.items():
        if n.startswith("adhoc:") or ns.retired:
            continue
        slots, full = node_slots(ns, by_node.get(n, []), now)
        slots, full = sched.cards.slots(ns.cfg.card, slots), sched.cards.slots(ns.cfg.card, full)  # a card's cap
        left = slow_start_left(ns, now) if slots < full else None
        nodes[n] = {**ns.snapshot(now), "inflight": sched.node_inflight.get(n, 0), "slots": slots,
                    "latency_ms": list(ns.latencies[-20:]),
                    # Slow start (docs/CONFIG.md, breaker.slow_start_sec): slots climbs to full_slots.
                    "full_slots": full, "ramping": left is not None,
                    "full_in_sec": None if left is None else round(left, 1),
                    # Cost and capacity (docs/CONFIG.md#cost-and-capacity): None when the node has no capacity.
                    "capacity": ns.cfg.capacity, "capacity_used": round(sched.capacity_used.get(n, 0.0), 3),
                    "card": ns.cfg.card,  # the GPU it shares with other nodes (docs/CONFIG.md#cards)
                    # Multi-model nodes (docs/CONFIG.md#multi-model-nodes): models null = it declares none.
                    "models": ns.models.listed(ns.cfg), "warm": list(ns.models.warm or ()),
                    "warm_models": ns.cfg.warm_models,
                    # Slow nodes (docs/CONFIG.md "nodes.<n>.slow"): null before a measured answer.
                    "speed": rt.speed.view(n), "slowed": ns.slowed}
        pn = rt.pool_nodes.get(n)
        if pn is not None:  # a rented node (docs/FLEET.md)
            nodes[n].update(pool=pn.pool, provider=pn.provider, instance_id=pn.instance_id,
                            price_per_hour=pn.price_per_hour)
    return {
        "config": rt.config_state(),
        "routes": routes,
        "nodes": nodes,
        "cards": cards_snapshot(sched),
        "uptime_sec": round(now - rt.started_at, 1),
        # Beyond the documented fields, for the dashboard: rolling outcome counts and percentiles, and cost.
        "stats": rt.stats.snapshot(),
        # machines: what the hourly price is paid for (nodes sharing a URL host are one machine).
        "cost": {**rt.cfg.cost.model_dump(), "machines": machines(n.url for n in rt.cfg.nodes.values())},
        **({"cluster": rt.cluster.state(rt.version)} if rt.cluster is not None else {}),
        **({"fleet": rt.fleet_view()} if rt.fleet_view is not None else {}),
    }


HISTORY_SERIES = ("queue_depth", "inflight")  # what the dashboard's route chart plots


def route_series(rt: Runtime) -> dict[str, tuple[int, int]]:
    """One observation of HISTORY_SERIES per configured route (cheap: no estimates)."""
    return {n: (rt.scheduler.depth(rq), sum(rq.inflight.values())) for n, rq in rt.scheduler.routes.items()
            if not n.startswith("adhoc:") and not rq.retired}


def route_readiness(rt: Runtime) -> dict[str, bool]:
    """Each configured route: whether some node of it (primary, standby or overflow) can take work now."""
    now = rt.clock()
    sched = rt.scheduler
    return {n: any(sched.nodes[x].serving(now) or sched.nodes[x].available(now)
                   for x in (*rq.all_nodes, *rq.cfg.overflow_nodes) if x in sched.nodes)
            for n, rq in sched.routes.items() if not n.startswith("adhoc:") and not rq.retired}


def readiness(rt: Runtime) -> list[str]:
    """Why /readyz says not ready; empty when every route has a node that can take work."""
    reasons = [f"route {n}: no node can take work" for n, ok in route_readiness(rt).items() if not ok]
    if rt.shutting_down:
        reasons.append("shutting down")
    return reasons


def health(rt: Runtime) -> list[str]:
    """Why ``GET /health`` says 503; empty while some route can serve (as an inference server's
    own /health answers 200 while it can take a request)."""
    if rt.shutting_down:
        return ["shutting down"]
    routes = route_readiness(rt)
    if any(routes.values()):
        return []
    return [f"route {n}: no node can take work" for n in routes] or ["no route configured"]
