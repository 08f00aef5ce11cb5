"""Cluster mode's parts, built in one place (docs/CLUSTER.md).

``build`` makes the Redis stores (leases, limits, jobs), the leader election (one voice) and the
shared node state for a Runtime that is being built, and hands them back as one ``Cluster``:
its ``wiring`` is what the Runtime takes at construction for its seams, ``attach`` gives the
job store to the jobs, and its ``start`` and ``stop`` keep the order the parts depend on.
"""

from __future__ import annotations

import dataclasses
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
from kilolined.ops.runtime import Component, Runtime, Wiring
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
    comfy_shared: SharedInputs
    comfy_lists: SharedLists
    rents_here: Callable[[], bool]
    comfy_ws: SocketBus | None = None  # started by the first ComfyUI /ws

    def wiring(self, local: Wiring) -> Wiring:
        """``local`` (the server's parts) with the Runtime's seams reaching the parts shared with
        the other gateways. One voice (docs/CLUSTER.md): the leader alone runs the health checks,
        sends the alerts and (docs/FLEET.md) rents."""
        alert, leader = local.alert, self.leader
        return dataclasses.replace(
            local, leases=self.leases, settle=self.leases.settle, cluster=self.leases.view, limits=self.limits,
            node_sync=self.node_sync, comfy_shared=self.comfy_shared, comfy_lists=self.comfy_lists,
            comfy_ws=self.comfy_ws, checks_here=leader.checks,
            rents_here=self.rents_here,
            alert=lambda event, text, node: alert(event, text, node) if leader.speaks(event) else None,
            components=(*local.components, Component("cluster", self.leases.commit, self.leases.prepare)))

    def attach(self, jobs: Jobs) -> None:
        """Jobs anywhere: every job mirrored into Redis, served by any gateway, carried on by one."""
        self.jobs.attach(jobs)
        jobs.store = self.jobs

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


def build(rt: Runtime) -> Cluster:
    """The cluster parts for ``rt`` (whose config has a ``cluster:`` section), made while it is
    built (its ``wire``): its lease store, limit store, job store, alerts (the leader's alone) and
    node sync. Nothing here is assigned onto ``rt``; callbacks reach it at call time."""
    cfg = rt.cfg.cluster
    assert cfg is not None
    # ``leader`` is made below from the store's Redis; the store asks it only once running.
    leases = ClusterLeases(rt.scheduler, cfg, gateway_id(rt.cfg), clock=rt.clock,
                           version=lambda: rt.version, alert=rt.notify, speaks=lambda event: leader.speaks(event))
    view = leases.view
    limits = SharedLimits(leases.redis, cfg.key_prefix, rt.limiter, rt.budgets, inst=leases.inst,
                          gateway_id=view.gateway_id, peers=leases.alive_peers,
                          redis_up=lambda: view.redis_up, clock=rt.clock, wire=leases.wire)
    leader = LeaderLease(leases.redis, cfg, leases.inst, view, leases.leadership, clock=rt.clock, alert=rt.notify,
                         on_restored=lambda: node_sync.republish())
    node_sync = NodeSync(
        leases.redis, cfg.key_prefix, leases.inst, lambda: rt.scheduler.nodes, clock=rt.clock,
        redis_up=lambda: view.redis_up, leader=lambda: leader.state.is_leader(rt.clock()),
        on_applied=lambda ns, events: rt.node_events(ns, events) if events else rt.wake(),
        sweep_sec=cfg.lease_ttl_sec / 3)
    cluster_jobs = ClusterJobs(rt, leases)  # given its Jobs by Cluster.attach
    alive_sec = 3 * cfg.lease_ttl_sec  # a peer seen within this counts as alive
    rt.metrics.registry.register(ClusterGauges(view, lambda: alive_sec))
    # Reaped slots in doubt: the leader asks their nodes whether they are free.
    doubt = DoubtCheck(leases, probes_of=lambda node: node_probes(rt, node),
                       fetch=lambda node, path: node_body(rt, node, path),
                       leader=lambda: leader.state.is_leader(rt.clock()), every_sec=cfg.lease_ttl_sec / 3)
    return Cluster(leases, limits, leader, node_sync, cluster_jobs, doubt,
                   budget_keys=lambda: [k for k, c in rt.cfg.keys.items() if c.budget is not None],
                   refresh_sec=cfg.lease_ttl_sec / 3,
                   comfy_shared=SharedInputs(leases.redis, cfg.key_prefix),  # an upload here, its prompt elsewhere
                   comfy_lists=SharedLists(leases.redis, cfg.key_prefix, rt.spawn),  # one history, queue, jobs list
                   rents_here=lambda: leader.state.is_leader(rt.clock()),
                   comfy_ws=SocketBus(leases.wire.pool, cfg.key_prefix, leases.inst))  # a /ws here, its prompt there


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
