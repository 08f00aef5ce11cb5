"""Both lease stores decide by one list of rules (SPEC §17, docs/ARCHITECTURE.md "Node choice"):
for random routes, nodes (health, drain, slow start, slowed, slots, capacities, cards, models
served and warm), counts and tickets (cost, model, prefix or session affinity, nodes that failed
it, barred or not, pinned), the ADMIT script on a real redis-server grants the node that
``queue.Scheduler.choose_node`` picks, or like it none, from the route view and the ticket's plan
the gateway wrote (cluster/leases.py ``route_view``, ``plan_json``) and Redis' own counts. And
over random runs of admissions, releases and the clock moving on, the order in which waiting
tickets get which node, backfill past a head that fits nowhere and priority aging included, is the
same in both stores for each strategy: both sort by the place scheduling/order.py gives a ticket."""

from __future__ import annotations

import math
from typing import Any

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.cluster import scripts
from kilolined.cluster.leases import place_json, plan_json, route_view
from kilolined.core.config import BreakerConfig, CardConfig, NodeConfig, RequestCostConfig, RouteConfig
from kilolined.scheduling import affinity as aff
from kilolined.scheduling.affinity import PrefixIndex
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, Rejected, RouteQueue, Scheduler, Ticket

from .harness import RedisServer

P = "eq:"
NAMES = ["a", "b", "c", "d", "e"]
NOW = 1000.0


def maybe(draw: Any, s: st.SearchStrategy[Any]) -> Any:
    return draw(st.one_of(st.none(), s))


@st.composite
def nodes(draw: Any) -> dict[str, Any]:
    primaries = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    rest = [n for n in NAMES if n not in primaries]
    standby = rest[:draw(st.integers(0, len(rest)))]
    return {
        "primaries": primaries, "standby": standby, "slots": draw(st.integers(1, 4)),
        "node": {n: {"cap": maybe(draw, st.integers(1, 4)), "capacity": maybe(draw, st.sampled_from([2.0, 4.0, 8.0])),
                     "card": maybe(draw, st.sampled_from(["g1", "g2"])),
                     "down": draw(st.sampled_from([False, False, False, True])),
                     "drained": draw(st.sampled_from([False, False, False, True])),
                     "slowed": draw(st.sampled_from([False, False, True])),
                     "ramp": maybe(draw, st.sampled_from([1.0, 5.0, 9.0])),  # seconds into a slow start of 10
                     "serves": draw(st.sampled_from([True, True, False])), "warm": draw(st.booleans())}
                 for n in primaries + standby},
        "cards": {c: {"max_concurrency": maybe(draw, st.integers(1, 3)),
                      "capacity": maybe(draw, st.sampled_from([3.0, 6.0]))} for c in ("g1", "g2")},
    }


def scheduler(scene: dict[str, Any], strategy: str = "fifo", max_bypass: int = 8) -> tuple[Scheduler, RouteQueue]:
    s = Scheduler()
    for c, cc in scene["cards"].items():
        s.cards.cfg[c] = CardConfig(**cc)
    for n, x in scene["node"].items():
        cfg = NodeConfig(url=f"http://10.0.0.{ord(n)}:1", models=["m", "x"] if x["serves"] else ["x"],
                         max_concurrency=x["cap"], capacity=x["capacity"], card=x["card"],
                         breaker=BreakerConfig(slow_start_sec=10))
        ns = s.nodes[n] = NodeState(n, cfg)
        ns.models.warm = ["m"] if x["warm"] else ["x"]
        ns.healthy = not x["down"]
        ns.drained = x["drained"]
        ns.slowed = x["slowed"]
        if x["ramp"] is not None:
            ns.recovered_at = NOW - x["ramp"]
    rq = s.routes["r"] = RouteQueue("r", RouteConfig(
        path="/r", nodes=scene["primaries"], standby=scene["standby"], max_concurrency=scene["slots"],
        affinity=scene.get("mode", "off"), affinity_block_bytes=16, strategy=strategy, max_bypass=max_bypass,
        cost=RequestCostConfig(unit="header:X-Cost"), queue_timeout_sec=3600))
    return s, rq


@st.composite
def choices(draw: Any) -> dict[str, Any]:
    scene = draw(nodes())
    every = scene["primaries"] + scene["standby"]
    scene["mode"] = draw(st.sampled_from(["off", "off", aff.PREFIX, aff.SESSION]))
    scene["counts"] = {n: (draw(st.integers(0, 4)), draw(st.integers(0, 2)), draw(st.sampled_from([0.0, 1.5, 3.0])))
                       for n in every}  # (the route's leases there, other routes' leases, their costs)
    scene["card_counts"] = {c: (draw(st.integers(0, 3)), draw(st.sampled_from([0.0, 2.0, 4.5]))) for c in ("g1", "g2")}
    scene["held"] = {n: draw(st.sampled_from([0, 0, 1, 2, 5])) for n in every}
    scene["ticket"] = {
        "model": draw(st.sampled_from([None, "m"])), "cost": draw(st.sampled_from([0.0, 1.0, 2.5, 5.0])),
        "doc": draw(st.integers(0, 20)),
        # a node that failed it: merely avoided (it answered), lost a while ago, or lost just now (barred)
        "avoid": {n: draw(st.sampled_from([-math.inf, NOW - 100, NOW])) for n in every if draw(st.booleans())
                  and draw(st.booleans())},
        "pin": draw(st.sampled_from([None] * 6 + every)),
    }
    return scene


def ticket(scene: dict[str, Any]) -> Ticket:
    x = scene["ticket"]
    a = None
    if scene["mode"] == aff.PREFIX:
        data = {"model": "m", "messages": [{"role": "user", "content": f"{x['doc']} document " * 8}]}
        a = aff.prefix_affinity("r", data, 16)
    elif scene["mode"] == aff.SESSION:
        a = aff.session_affinity("r", f"s{x['doc']}")
    t = Ticket(1, "r", "k", 0, NOW, model=x["model"], cost=x["cost"], affinity=a, pinned_node=x["pin"])
    t.avoid = dict(x["avoid"])
    return t


def counted(s: Scheduler, rq: RouteQueue, scene: dict[str, Any], t: Ticket) -> None:
    """The scene's counts, in the scheduler (and its prefix indexes)."""
    for n, (mine, other, used) in scene["counts"].items():
        if mine:
            rq.inflight[n] = mine
        if mine + other:
            s.node_inflight[n] = mine + other
            s.capacity_used[n] = used
    for c, (k, used) in scene["card_counts"].items():
        if k:
            s.cards.inflight[c] = k
            s.cards.used[c] = used
    if t.affinity is not None and t.affinity.mode == aff.PREFIX:
        for n, k in scene["held"].items():
            if k:
                s.indexes[n] = PrefixIndex()
                s.indexes[n].record(t.affinity.keys[:k])


def mirrored(r: redis.Redis, s: Scheduler, rq: RouteQueue) -> None:
    """The scheduler's counts, in Redis."""
    r.flushdb()
    for h, counts in ((P + "in:r", rq.inflight), (P + "nin", s.node_inflight), (P + "ncost", s.capacity_used),
                      (P + "cin", s.cards.inflight), (P + "ccost", s.cards.used)):
        for f, v in counts.items():
            r.hset(h, f, repr(v))


def admit(r: redis.Redis, s: Scheduler, rq: RouteQueue, t: Ticket, tid: str, now: float) -> list[str]:
    """ADMIT as ClusterLeases.settle sends it, at ``now`` on both clocks; returns the grants
    ("tid lid node")."""
    out = r.eval(scripts.ADMIT, 0, P, "gw#1", "r", place_json(rq.cfg, t, now), tid, plan_json(s, t, now),
                 orjson.dumps(route_view(s, rq, now)).decode(), 1000, -1, t.key, 0, repr(t.cost))
    assert out[0] == b"ok"
    return [g.decode() for g in out[3:]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(choices())
def test_both_stores_choose_the_same_node(redis_server: RedisServer, scene: dict[str, Any]) -> None:
    s, rq = scheduler(scene)
    t = ticket(scene)
    counted(s, rq, scene, t)
    r = redis.Redis(port=redis_server.port)
    try:
        mirrored(r, s, rq)
        grants = admit(r, s, rq, t, "t1", NOW)
    finally:
        r.close()
    node = grants[0].split(" ")[2] if grants else None
    assert node == s.choose_node(rq, t, NOW)


# --- order and backfill over a run ------------------------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(["k1", "k2", "k3"]), st.integers(0, 2),
              st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0]), st.sampled_from([None, None, None, 0, 1])),
    st.tuples(st.just("release"), st.integers(0, 20)),
    # The clock moves on: priority ages +1 per queue_timeout_sec / 4 = 900 s waited (scheduler()).
    st.tuples(st.just("wait"), st.sampled_from([100.0, 450.0, 900.0, 2700.0]))), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nodes(), st.sampled_from(["fifo", "fifo_fair_lease", "priority"]), st.integers(0, 2), OPS)
def test_both_stores_serve_the_queue_in_the_same_order(redis_server: RedisServer, scene: dict[str, Any],
                                                        strategy: str, max_bypass: int, ops: list[Any]) -> None:
    served_alike(redis_server, scene, strategy, max_bypass, ops)


def test_both_stores_age_alike(redis_server: RedisServer) -> None:
    """One slot: a priority-0 request waits 3 aging steps, then a priority-2 one comes: both
    stores serve the older first (0 + 3 > 2 + 0), on the clock the gateway passes."""
    one = {"cap": None, "capacity": None, "card": None, "down": False, "drained": False, "slowed": False,
           "ramp": None, "serves": True, "warm": True}
    scene = {"primaries": ["a"], "standby": [], "slots": 1, "node": {"a": one}, "cards": {}}
    ops = [("admit", "k1", 0, 0.0, None), ("admit", "k2", 0, 0.0, None), ("wait", 2700.0),
           ("admit", "k3", 2, 0.0, None), ("release", 0), ("release", 0)]
    served_alike(redis_server, scene, "priority", 8, ops)


def served_alike(redis_server: RedisServer, scene: dict[str, Any], strategy: str, max_bypass: int,
                 ops: list[Any]) -> None:
    """Runs ``ops`` against both stores and checks they grant the same tickets on the same nodes."""
    for x in scene["node"].values():
        x["serves"], x["ramp"] = True, None  # (a plan is made at admission: nothing in it may change meanwhile)
        x["capacity"] = x["capacity"] or 4.0  # costs hold requests back: backfill
    local, _ = scheduler(scene, strategy, max_bypass)
    gw, grq = scheduler(scene, strategy, max_bypass)  # the gateway's own view, which makes the plans
    every = scene["primaries"] + scene["standby"]
    r = redis.Redis(port=redis_server.port)
    r.flushdb()
    mine: dict[str, Ticket] = {}  # tid -> the gateway's ticket
    by_tid: dict[str, str] = {}  # tid -> its Redis lease id

    def landed(grants: list[str]) -> list[tuple[str, str]]:
        out = []
        for g in grants:
            tid, lid, node = g.split(" ")
            out.append((tid, node))
            gt = mine[tid]
            gw.grant(grq, gt, node, now)  # as ClusterLeases._granted: the gateway's counts follow
            by_tid[tid] = lid
        return out

    def local_leases(before: set[int]) -> list[tuple[str, str]]:
        return [(f"t{t.seq}", t.lease.node) for t in tickets.values()
                if t.state == LEASED and t.lease is not None and t.seq not in before]

    tickets: dict[int, Ticket] = {}
    now = NOW
    try:
        for op in ops:
            leased = {t.seq for t in tickets.values() if t.state == LEASED}
            if op[0] == "wait":
                now += op[1]
            elif op[0] == "admit":
                _, key, prio, cost, pin = op
                pin_node = None if pin is None else every[pin % len(every)]
                try:
                    t = local.admit("r", key, prio, now, cost=cost, pinned_node=pin_node)
                except Rejected:
                    continue  # too costly for any node (422): refused before either store queues it
                tickets[t.seq] = t
                gt = Ticket(t.seq, "r", key, prio, now, cost=cost, pinned_node=pin_node)
                mine[f"t{t.seq}"] = gt
                got = landed(admit(r, gw, grq, gt, f"t{t.seq}", now))
                assert sorted(got) == sorted(local_leases(leased)), op
            else:
                live = [t for t in tickets.values() if t.state == LEASED and t.lease is not None]
                if not live:
                    continue
                t = live[op[1] % len(live)]
                assert t.lease is not None
                local.release(t.lease, now, None)
                made = [(f"t{lease.ticket.seq}", lease.node) for lease in local.dispatch(now)]
                tid = f"t{t.seq}"
                lid = by_tid.pop(tid)
                gl = mine[tid].lease
                assert gl is not None
                gw.release(gl, now, None)
                got = landed([g.decode() for g in r.eval(scripts.RELEASE, 0, P, "gw#1", lid)])
                assert got == made, op  # the same tickets on the same nodes, in the same order
    finally:
        r.close()


def test_both_stores_put_the_re_queued_first_the_latest_first(redis_server: RedisServer) -> None:
    """Two leases re-queued (their node failed) go before the waiting one, the later re-queued
    first, in both stores: their places sit far below every other score (order.FRONT)."""
    one = {"cap": None, "capacity": None, "card": None, "down": False, "drained": False, "slowed": False,
           "ramp": None, "serves": True, "warm": True}
    scene = {"primaries": ["a"], "standby": [], "slots": 2, "node": {"a": one}, "cards": {}}
    r = redis.Redis(port=redis_server.port)
    r.flushdb()
    try:
        for strategy in ("fifo", "fifo_fair_lease", "priority"):
            r.flushdb()
            s, rq = scheduler(scene, strategy)
            ts = [s.admit("r", f"k{i}", i, NOW + i) for i in range(3)]
            lids = {}
            for i, t in enumerate(ts):
                for g in admit(r, s, rq, Ticket(t.seq, "r", t.key, t.priority, NOW + i), f"t{t.seq}", NOW + i):
                    tid, lid, _ = g.split(" ")
                    lids[tid] = lid
            s.nodes["a"].healthy = False  # (nothing is granted again: only the order shows)
            r.set(P + "v:r", orjson.dumps(route_view(s, rq, NOW)).decode())
            for t in ts[:2]:
                assert t.lease is not None
                s.requeue(t.lease, NOW + 5, avoid_node=False)
                wire = place_json(rq.cfg, t, NOW + 5, front=True)
                r.eval(scripts.REQUEUE, 0, P, "gw#1", lids[f"t{t.seq}"], f"t{t.seq}", "r", wire, t.key, "0.0",
                       plan_json(s, t, NOW + 5))
            local = [f"t{t.seq}" for t in s.routes["r"].waiting.order()]
            remote = [m.decode()[15:] for m in r.zrange(P + "o:r", 0, -1)]
            assert local == remote == [f"t{ts[1].seq}", f"t{ts[0].seq}", f"t{ts[2].seq}"], strategy
    finally:
        r.close()
