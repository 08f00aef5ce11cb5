"""Cluster mode's parts, built in one place (docs/CLUSTER.md).

``build`` makes the Redis stores (leases, limits, jobs), the leader election (one voice) and the
shared node state for a Runtime, plugs them into the Runtime's seams, and hands them back as one
``Cluster`` whose ``start`` and ``stop`` keep the order the parts depend on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kilolined.cluster.comfyfiles import SharedInputs
from kilolined.cluster.comfylists import SharedLists
from kilolined.cluster.comfyws import SocketBus
from kilolined.cluster.doubt import DoubtCheck, Probe, probes
from kilolined.cluster.jobs import ClusterJobs
from kilolined.cluster.leader import LeaderLease
from kilolined.cluster.leases import ClusterLeases, gateway_id
from kilolined.cluster.limits import SharedLimits
from kilolined.cluster.nodes import NodeSync
from kilolined.cluster.view import ClusterGauges
from kilolined.modes.jobs import Jobs
from kilolined.ops.runtime import Component, Runtime
from kilolined.scheduling.queue import Rejected, Ticket

CHECK_SEC = 5.0  # one node check of slots in doubt


@dataclass
class Cluster:
    """What the server starts and stops in cluster mode; the Runtime already uses each part."""

    leases: ClusterLeases
    limits: SharedLimits
    leader: LeaderLease
    node_sync: NodeSync
    jobs: ClusterJobs
    doubt: DoubtCheck
    budget_keys: Callable[[], list[str]]  # the keys with a budget, whose usage ``limits`` re-reads
    refresh_sec: float
    comfy_ws: SocketBus | None = None  # started by the first ComfyUI /ws

    async def start(self) -> None:
        await self.node_sync.start()  # first: the leases' first heartbeat writes slots from this view
        await self.leases.start()
        await self.leader.start()
        await self.jobs.start()
        self.limits.start(self.budget_keys, self.refresh_sec)
        self.doubt.start()

    def fail_all_waiting(self, err: Callable[[], Rejected]) -> list[Ticket]:
        return self.leases.fail_all_waiting(err)

    async def stop(self) -> None:
        if self.comfy_ws is not None:
            await self.comfy_ws.stop()  # the other gateways stop publishing here
        await self.doubt.stop()
        await self.limits.stop()  # the last usage to Redis before it is closed
        await self.node_sync.stop()
        await self.leader.stop()  # hands the voice on at once
        await self.jobs.stop()  # the last events and endings reach Redis first
        await self.leases.stop()


def build(rt: Runtime, jobs: Jobs) -> Cluster:
    """The cluster parts for ``rt`` (whose config has a ``cluster:`` section), already in use by
    it: its lease store, limit store, job store, alerts (the leader's alone) and node sync."""
    cfg = rt.cfg.cluster
    assert cfg is not None
    leases = ClusterLeases(rt.scheduler, cfg, gateway_id(rt.cfg), clock=rt.clock,
                           version=lambda: rt.version, alert=rt.notify)
    view = leases.view
    limits = SharedLimits(leases.redis, cfg.key_prefix, rt.limiter, rt.budgets, inst=leases.inst,
                          gateway_id=view.gateway_id, peers=leases.alive_peers,
                          redis_up=lambda: view.redis_up, clock=rt.clock, wire=leases.wire)
    leader = LeaderLease(leases.redis, cfg, leases.inst, view, leases.leadership, clock=rt.clock, alert=rt.notify,
                         on_restored=lambda: rt.node_sync.republish() if rt.node_sync else None)
    node_sync = NodeSync(
        leases.redis, cfg.key_prefix, leases.inst, lambda: rt.scheduler.nodes, clock=rt.clock,
        redis_up=lambda: view.redis_up, leader=lambda: leader.state.is_leader(rt.clock()),
        on_applied=lambda ns, events: rt.node_events(ns, events) if events else rt.wake(),
        sweep_sec=cfg.lease_ttl_sec / 3)
    # Jobs anywhere: every job mirrored into Redis, served by any gateway, carried on by one.
    cluster_jobs = ClusterJobs(rt, leases)
    cluster_jobs.attach(jobs)
    jobs.store = cluster_jobs

    # The Runtime's seams: each one now reaches the part shared with the other gateways.
    rt.leases, rt.settle, rt.cluster, rt.limits = leases, leases.settle, view, limits
    rt.components.append(Component("cluster", leases.commit, leases.prepare))
    alive_sec = 3 * cfg.lease_ttl_sec  # a peer seen within this counts as alive
    rt.metrics.registry.register(ClusterGauges(view, lambda: alive_sec))
    # One voice (docs/CLUSTER.md): the leader alone runs the health checks and sends the alerts.
    alert = rt.alert
    rt.alert = lambda event, text, node: alert(event, text, node) if leader.speaks(event) else None
    rt.checks_here = leader.checks
    rt.rents_here = lambda: leader.state.is_leader(rt.clock())  # docs/FLEET.md: only the leader rents
    rt.node_sync = node_sync
    rt.comfy_shared = SharedInputs(leases.redis, cfg.key_prefix)  # an upload here, its prompt elsewhere
    rt.comfy_lists = SharedLists(leases.redis, cfg.key_prefix, rt.spawn)  # one history, queue, jobs list
    rt.comfy_ws = SocketBus(leases.wire.pool, cfg.key_prefix, leases.inst)  # a /ws here, its prompt elsewhere
    # Reaped slots in doubt: the leader asks their nodes whether they are free.
    doubt = DoubtCheck(leases, probes_of=lambda node: node_probes(rt, node),
                       fetch=lambda node, path: node_body(rt, node, path),
                       leader=lambda: leader.state.is_leader(rt.clock()), every_sec=cfg.lease_ttl_sec / 3)
    return Cluster(leases, limits, leader, node_sync, cluster_jobs, doubt,
                   budget_keys=lambda: [k for k, c in rt.cfg.keys.items() if c.budget is not None],
                   refresh_sec=cfg.lease_ttl_sec / 3, comfy_ws=rt.comfy_ws)


def node_kind(rt: Runtime, node: str) -> str | None:
    """The kind of the first route that sends to ``node`` (None: no route does)."""
    for r in rt.cfg.routes.values():
        if node in r.nodes or node in r.standby:
            return r.kind
    return None


def node_probes(rt: Runtime, node: str) -> list[Probe]:
    """What to ask ``node`` about what it runs: its ``busy``, else by the kind of its route."""
    ns = rt.scheduler.nodes.get(node)
    return probes(node_kind(rt, node), ns.cfg.busy if ns is not None else None)


async def node_body(rt: Runtime, node: str, path: str) -> bytes:
    """GET ``path`` on the node (its own headers, e.g. llama.cpp's --api-key): the body of a 2xx."""
    ns = rt.scheduler.nodes[node]
    async with rt.session(node).get(ns.cfg.url.rstrip("/") + path, headers=ns.cfg.headers,
                                    timeout=aiohttp.ClientTimeout(total=CHECK_SEC)) as r:
        r.raise_for_status()
        return await r.read()
