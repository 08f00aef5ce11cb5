"""What the operator sees of the cluster: /admin/state's ``cluster`` and the cluster gauges.

Plain data, written by the cluster lease store at each heartbeat, read by the views."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass
class Peer:
    id: str
    last_seen_sec: float
    config_version: str


@dataclass
class Lost:
    """A gateway whose heartbeat lapsed: its share stays reserved (counted as in use) in Redis."""

    id: str
    lost_sec: float
    #: what its reservation holds: {"routes": {route: slots per node}, "nodes": {node: slots}, "capacity": part}
    reserved: dict[str, Any]


async def _no_forget(gateway_id: str) -> str:
    return "unknown"


@dataclass
class ClusterView:
    gateway_id: str
    leader: str | None = None
    redis_up: bool = False
    reached: bool = False  # Redis answered this process once (until then it takes no slot: /healthz "degraded")
    peers: list[Peer] = field(default_factory=list)  # the *other* gateways, as of the last heartbeat
    lost: list[Lost] = field(default_factory=list)  # the gateways whose share is reserved, as of then
    #: POST /admin/cluster/forget/{id}: "forgotten" | "alive" | "unknown" (the lease store's)
    forget: Callable[[str], Awaitable[str]] = _no_forget

    def state(self, config_version: str) -> dict[str, Any]:
        return {
            "gateway_id": self.gateway_id,
            "leader": self.leader,
            "redis": "up" if self.redis_up else "down",
            "peers": [{"id": p.id, "last_seen_sec": round(p.last_seen_sec, 1), "config_version": p.config_version,
                       "same_config": p.config_version == config_version} for p in self.peers],
            "lost": [{"id": g.id, "lost_sec": round(g.lost_sec, 1), "reserved": g.reserved} for g in self.lost],
        }


class ClusterGauges(Collector):
    """kiloline_cluster_peers, kiloline_cluster_redis_up, kiloline_cluster_leader."""

    def __init__(self, view: ClusterView, alive_sec: Callable[[], float]):
        self.view = view
        self.alive_sec = alive_sec

    def collect(self) -> Iterable[GaugeMetricFamily]:
        v = self.view
        peers = GaugeMetricFamily("kiloline_cluster_peers", "Other gateways seen alive")
        peers.add_metric([], sum(1 for p in v.peers if p.last_seen_sec <= self.alive_sec()))
        up = GaugeMetricFamily("kiloline_cluster_redis_up", "1 while Redis answers")
        up.add_metric([], 1 if v.redis_up else 0)
        leader = GaugeMetricFamily("kiloline_cluster_leader", "1 on the gateway that is the leader")
        leader.add_metric([], 1 if v.redis_up and v.leader == v.gateway_id else 0)
        yield from (peers, up, leader)
