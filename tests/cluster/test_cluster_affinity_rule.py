"""The cluster's scripts choose a node by the same affinity rule as one gateway alone: for random
nodes, slots, loads, warm sets and prefix indexes, the ADMIT script on a real redis-server grants
the node that ``queue.Scheduler.choose_node`` picks (or, like it, none), from the plan the
gateway's rules made (its index's matches in rank columns) and Redis' own in-flight counts; and
the outcome the gateway counts when that grant arrives (``affine_landed``) is the one it would
have counted deciding alone (docs/CLUSTER.md, docs/CONFIG.md#affinity)."""

from __future__ import annotations

from typing import Any

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.cluster import scripts
from kilolined.cluster.leases import place_json, plan_json, route_view
from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling import affinity as aff
from kilolined.scheduling.affinity import PrefixIndex
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import RouteQueue, Scheduler, Ticket

from .harness import RedisServer

P = "eq:"
NAMES = ["a", "b", "c", "d"]


@st.composite
def scenes(draw: Any) -> dict[str, Any]:
    primaries = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    standby = [n for n in NAMES if n not in primaries][:draw(st.integers(0, 1))]
    slots = draw(st.integers(1, 5))
    everyone = primaries + standby
    return {
        "primaries": primaries, "standby": standby, "slots": slots,
        "mode": draw(st.sampled_from([aff.PREFIX, aff.SESSION])),
        "doc": draw(st.integers(0, 30)), "extra": draw(st.integers(0, 300)),
        "inflight": {n: draw(st.integers(0, slots)) for n in everyone},
        # the leading keys of the request each holds (often none: a new prefix goes by rendezvous)
        "held": {n: draw(st.sampled_from([0, 0, 0, 1, 2, 5, 12])) for n in everyone},
        "down": {n for n in everyone if draw(st.booleans()) and draw(st.booleans())},
        "warm": None if draw(st.booleans()) else {n for n in everyone if draw(st.booleans())},
        "slowed": {n for n in everyone if draw(st.booleans()) and draw(st.booleans())},
    }


def scheduler(scene: dict[str, Any]) -> tuple[Scheduler, RouteQueue, Ticket]:
    s = Scheduler()
    warm = scene["warm"]
    for n in scene["primaries"] + scene["standby"]:
        ns = s.nodes[n] = NodeState(n, NodeConfig(url=f"http://10.0.0.{ord(n)}:1", models=["m"]))
        ns.models.warm = ["m"] if warm is not None and n in warm else ["other"]
        ns.healthy = n not in scene["down"]
        ns.slowed = n in scene["slowed"]
    rq = s.routes["r"] = RouteQueue("r", RouteConfig(path="/r", nodes=scene["primaries"], standby=scene["standby"],
                                                     max_concurrency=scene["slots"], affinity=scene["mode"],
                                                     affinity_block_bytes=16))
    data = {"model": "m", "messages": [{"role": "user", "content": f"{scene['doc']} document " * 8
                                        + "x" * scene["extra"]}]}
    a = (aff.prefix_affinity("r", data, 16) if scene["mode"] == aff.PREFIX
         else aff.session_affinity("r", f"s{scene['doc']}"))
    assert a is not None
    for n, k in scene["held"].items():
        if k and a.mode == aff.PREFIX:
            idx = s.indexes[n] = PrefixIndex()
            idx.record(a.keys[:k])
    for n, k in scene["inflight"].items():
        if k:
            s.node_inflight[n] = rq.inflight[n] = k
    model = "m" if warm is not None else None
    return s, rq, Ticket(1, "r", "k", 0, 0.0, model=model, affinity=a)


def granted(r: redis.Redis, s: Scheduler, rq: RouteQueue, t: Ticket) -> str | None:
    r.flushdb()
    for n, k in rq.inflight.items():
        r.hset(P + "nin", n, k)
        r.hset(P + "in:r", n, k)
    view = orjson.dumps(route_view(s, rq, 0.0)).decode()
    out = r.eval(scripts.ADMIT, 0, P, "gw#1", "r", place_json(rq.cfg, t, 0.0), "tid1", plan_json(s, t, 0.0), view,
                 100, -1, "k", 0, "0")
    assert out[0] == b"ok"
    if out[2] != 0 or len(out) == 3:
        return None  # queued
    _tid, _lid, node = out[3].decode().split(" ")
    return node


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenes())
def test_the_scripts_choose_as_one_gateway_would(redis_server: RedisServer, scene: dict[str, Any]) -> None:
    s, rq, t = scheduler(scene)
    r = redis.Redis(port=redis_server.port)
    try:
        node = granted(r, s, rq, t)
    finally:
        r.close()
    assert node == s.choose_node(rq, t, 0.0)
    # The gateway names the outcome when the grant arrives as it would have deciding alone.
    a = t.affinity
    assert a is not None
    if node is not None:
        alone = a.outcome
        a.node = a.outcome = None
        s.affine_landed(rq, t, node)
        assert a.outcome == alone and a.node == node
