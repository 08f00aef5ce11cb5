"""While Redis is down a gateway runs its share of every slot count (docs/CLUSTER.md): an
overlay on the live configs, so a route or node made meanwhile — an ad-hoc ``/v1/proxy`` target
(kilolined/ops/adhoc.py), a reload — is cut like the others, and nothing undoes the cut."""

from __future__ import annotations

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import ClusterConfig, NodeConfig, RouteConfig
from kilolined.ops.adhoc import AdhocTargets
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, RouteQueue, Scheduler

TTL = 3.0


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


async def alone(gid: str, peer: str) -> tuple[Scheduler, ClusterLeases, Clock]:
    """A gateway that had Redis (and saw ``peer`` alive), lost it, and is past its first TTL alone."""
    s = Scheduler()
    s.nodes["gpu"] = NodeState("gpu", NodeConfig(url="http://10.0.0.1:8000", max_concurrency=4))
    s.routes["r"] = RouteQueue("r", RouteConfig(path="/r", nodes=["gpu"], max_concurrency=4))
    clock = Clock()
    cfg = ClusterConfig(redis_url="redis://127.0.0.1:1/0", gateway_id=gid, lease_ttl_sec=TTL)
    leases = ClusterLeases(s, cfg, gid, clock=clock, version=lambda: "v", alert=lambda *a: None)
    leases.view.redis_up = leases.view.reached = True
    leases._seen[peer] = clock()
    leases._lost(OSError("cut off"))
    clock.t += TTL
    leases._cut(leases.alive_peers())  # what the heartbeat does once the first TTL is over
    return s, leases, clock


def run(s: Scheduler, route: str, n: int, now: float) -> int:
    """Admit ``n`` requests on ``route``; how many were leased at once."""
    return sum(s.admit(route, "k", 0, now).state == LEASED for _ in range(n))


async def test_the_share_holds_on_routes_and_nodes_made_during_the_outage() -> None:
    # Two gateways: "a" gets ⌈n/2⌉, "b" ⌊n/2⌋ of every count.
    for gid, peer, one_slot in (("a", "b", 1), ("b", "a", 0)):
        s, leases, clock = await alone(gid, peer)
        try:
            assert run(s, "r", 4, clock()) == 2  # a configured route: its share of 4
            adhoc = AdhocTargets(s, leases.forget_route, lambda node: None)
            # A 1-slot ad-hoc queue opened during the outage: 1 on one gateway, 0 on the other,
            # never 1 on each.
            rec = adhoc.open("bob", "http://10.0.0.9:7000", 1, clock())
            assert run(s, rec.name, 3, clock()) == one_slot
            # A new ad-hoc target: its node cap of 8 is cut like every other (4 of 8 here).
            wide = adhoc.open("carol", "http://10.0.0.8:7000", 8, clock())
            assert run(s, wide.name, 8, clock()) == 4
        finally:
            await leases.redis.aclose()
