"""A grant's Target is reused while the route's and the node's configs are the same objects, and
made anew as soon as a reload replaced either: a lease always carries the configs of its grant."""

from __future__ import annotations

from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, RouteQueue, Scheduler, Ticket


def scheduler() -> Scheduler:
    s = Scheduler()
    s.nodes["a"] = NodeState("a", NodeConfig(url="http://10.0.0.1:8000"))
    s.routes["r"] = RouteQueue("r", RouteConfig(path="/r", nodes=["a"], max_concurrency=10, request_timeout_sec=5))
    return s


def lease_one(s: Scheduler, now: float) -> Ticket:
    t = s.admit("r", "k", 0, now)
    assert t.state == LEASED and t.lease is not None
    return t


def test_same_configs_same_target_new_configs_new_target() -> None:
    s = scheduler()
    first = lease_one(s, 0.0).lease
    second = lease_one(s, 1.0).lease
    assert first is not None and second is not None
    assert second.target is first.target

    # A reload replaces the node's config: the next grant goes by the new one, the running lease not.
    s.nodes["a"].cfg = NodeConfig(url="http://10.0.0.2:9000", headers={"X-N": "2"})
    third = lease_one(s, 2.0).lease
    assert third is not None and third.target.url == "http://10.0.0.2:9000"
    assert third.target.headers == {"X-N": "2"}
    assert first.target.url == "http://10.0.0.1:8000"

    # ... and the route's.
    s.routes["r"].configure(RouteConfig(path="/r", nodes=["a"], max_concurrency=10, request_timeout_sec=60), 3.0)
    fourth = lease_one(s, 3.0).lease
    assert fourth is not None and fourth.target.request_timeout_sec == 60
    assert third.target.request_timeout_sec == 5 and fourth.target.node is third.target.node
