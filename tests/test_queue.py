"""kilolined.scheduling.queue: the lease scheduler as pure logic, driven with a hand-made clock (SPEC §3.3, §3.4)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.core.config import BreakerConfig, CardConfig, HealthConfig, NodeConfig, RequestCostConfig, RouteConfig
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import (
    DONE,
    EPS,
    FAILED,
    LEASED,
    WAITING,
    Rejected,
    RouteQueue,
    Scheduler,
    Ticket,
    ramped_capacity,
)

# --- helpers ------------------------------------------------------------------------------------


def node(name: str, cap: int | None = None, **kw: Any) -> NodeState:
    return NodeState(name, NodeConfig(url=f"http://10.0.0.1:{8000 + len(name)}", max_concurrency=cap, **kw))


def rcfg(nodes: list[str] | None = None, **kw: Any) -> RouteConfig:
    return RouteConfig(path="/r", nodes=nodes or ["a"], **kw)


def make(routes: dict[str, RouteConfig], nodes: list[NodeState]) -> Scheduler:
    s = Scheduler()
    for ns in nodes:
        s.nodes[ns.name] = ns
    for name, cfg in routes.items():
        s.routes[name] = RouteQueue(name, cfg)
    return s


class Waker:
    """Records every on_wake call, in order."""

    def __init__(self) -> None:
        self.calls: list[Ticket] = []

    def __call__(self, t: Ticket) -> None:
        self.calls.append(t)


def finish(s: Scheduler, t: Ticket, now: float) -> None:
    """Complete a leased ticket and hand out the freed slot (what Runtime.release does)."""
    assert t.state == LEASED and t.lease is not None
    s.release(t.lease, now, service_time=1.0)
    s.dispatch(now)


def serve_all(s: Scheduler, route: str, first: Ticket, now: float = 0.0) -> list[Ticket]:
    """With one slot: finish whatever holds it, repeatedly; returns tickets in lease order."""
    order = [first]
    current = first
    while True:
        finish(s, current, now)
        nxt = [t for t in _all_tickets(s, route) if t.state == LEASED]
        if not nxt:
            return order
        assert len(nxt) == 1
        current = nxt[0]
        order.append(current)


_tracked: dict[str, list[Ticket]] = {}


def _all_tickets(s: Scheduler, route: str) -> list[Ticket]:
    return _tracked[route]


def admit(s: Scheduler, route: str, key: str, now: float = 0.0, priority: int = 0, **kw: Any) -> Ticket:
    t = s.admit(route, key, priority, now, **kw)
    _tracked.setdefault(route, []).append(t)
    return t


@pytest.fixture(autouse=True)
def _reset_tracked() -> None:
    _tracked.clear()


# --- strategies ---------------------------------------------------------------------------------


def test_fifo_serves_in_arrival_order() -> None:
    s = make({"r": rcfg(strategy="fifo", max_concurrency=1)}, [node("a")])
    keys = ["x", "y", "x", "z", "y", "x"]
    ts = [admit(s, "r", k, now=i) for i, k in enumerate(keys)]
    assert ts[0].state == LEASED and all(t.state == WAITING for t in ts[1:])
    assert [s.position(t, 10) for t in ts[1:]] == [1, 2, 3, 4, 5]
    assert serve_all(s, "r", ts[0], 10) == ts


def test_fair_lease_key_with_one_waiting_is_not_behind_a_key_with_many() -> None:
    s = make({"r": rcfg(strategy="fifo_fair_lease", max_concurrency=1, max_queue_depth=100)}, [node("a")])
    a = [admit(s, "r", "A", now=i * 0.01) for i in range(20)]
    b = admit(s, "r", "B", now=1.0)
    assert a[0].state == LEASED
    # positions: A's next, then B (round robin), then the rest of A
    assert s.position(a[1], 1.0) == 1
    assert s.position(b, 1.0) == 2
    assert s.position(a[2], 1.0) == 3
    order = serve_all(s, "r", a[0], 2.0)
    assert len(order) == 21
    # B is dispatched before A's third waiting request (and in fact before its second).
    assert order.index(b) < order.index(a[3])
    assert order.index(b) < order.index(a[2])
    # FIFO within A
    assert [t for t in order if t.key == "A"] == a


def test_fair_lease_round_robin_across_three_keys() -> None:
    s = make({"r": rcfg(strategy="fifo_fair_lease", max_concurrency=1)}, [node("a")])
    first = admit(s, "r", "X")
    ts = [admit(s, "r", k, now=i) for i, k in enumerate("AAABBC")]
    pos = {f"{t.key}{i}": s.position(t, 9) for i, t in enumerate(ts)}
    # rounds: A B C | A B | A
    assert pos == {"A0": 1, "B3": 2, "C5": 3, "A1": 4, "B4": 5, "A2": 6}
    order = serve_all(s, "r", first, 9)
    assert [t.key for t in order[1:]] == list("ABCABA")


def test_priority_higher_first_fifo_within_level() -> None:
    s = make({"r": rcfg(strategy="priority", max_concurrency=1, queue_timeout_sec=40)}, [node("a")])
    first = admit(s, "r", "k0", now=0)
    lo = admit(s, "r", "lo", priority=0, now=1)
    hi1 = admit(s, "r", "hi", priority=5, now=2)
    mid = admit(s, "r", "mid", priority=2, now=3)
    hi2 = admit(s, "r", "hi", priority=5, now=4)
    assert [s.position(t, 4) for t in (hi1, hi2, mid, lo)] == [1, 2, 3, 4]
    assert serve_all(s, "r", first, 4) == [first, hi1, hi2, mid, lo]


def test_priority_aging_one_level_per_quarter_timeout() -> None:
    """queue_timeout_sec 40 -> +1 priority per 10 s waited, continuously (scheduling/order.py): a
    request of priority p goes ahead of one of p + k once it has waited k × 10 s longer, on a tie
    the earlier first, and two waiting requests never swap as the clock moves on."""
    s = make({"r": rcfg(strategy="priority", max_concurrency=1, queue_timeout_sec=40)}, [node("a")])
    admit(s, "r", "busy", now=0)
    low = admit(s, "r", "low", priority=0, now=0)
    high = admit(s, "r", "high", priority=2, now=19)  # low waited 1.9 steps longer: not 2
    even = admit(s, "r", "even", priority=2, now=20)  # low waited 2 steps longer: a tie, low first
    higher = admit(s, "r", "higher", priority=3, now=35)  # low 0 + 3.5 steps, higher 3 + 0
    for now in (35, 36, 60, 1000):
        assert [s.position(t, now) for t in (high, low, even, higher)] == [1, 2, 3, 4]


def test_priority_aging_lets_a_low_priority_request_through_a_stream_of_high_ones() -> None:
    """Every 2 s a new priority-3 request arrives and one finishes; the priority-0 one still gets
    served before its queue_timeout_sec (40 s → +1 per 10 s)."""
    s = make({"r": rcfg(strategy="priority", max_concurrency=1, queue_timeout_sec=40)}, [node("a")])
    running = admit(s, "r", "hi", priority=3, now=0)
    for i in range(3):
        admit(s, "r", "hi", priority=3, now=0.1 * (i + 1))
    low = admit(s, "r", "lo", priority=0, now=0.5)
    now = 0.5
    served_low_at = None
    while now < 40:
        now += 2
        assert not s.expire(now)
        admit(s, "r", "hi", priority=3, now=now)
        s.release(running.lease, now, 2.0)  # type: ignore[arg-type]
        s.dispatch(now)
        running = next(t for t in _tracked["r"] if t.state == LEASED)
        if running is low:
            served_low_at = now
            break
    assert served_low_at is not None, "the low-priority request starved"
    assert served_low_at - 0.5 < 40


# --- admission: drop policies, per-key cap, timeout -------------------------------------------


def full_route(policy: str, depth: int = 2, **kw: Any) -> tuple[Scheduler, list[Ticket], list[Waker]]:
    s = make({"r": rcfg(max_concurrency=1, max_queue_depth=depth, drop_policy=policy, strategy="fifo",
                        expected_duration_sec=4, **kw)}, [node("a")])
    wakers = [Waker() for _ in range(depth + 1)]
    ts = [admit(s, "r", f"k{i}", now=i, on_wake=wakers[i]) for i in range(depth + 1)]
    assert ts[0].state == LEASED and all(t.state == WAITING for t in ts[1:])
    return s, ts, wakers


@pytest.mark.parametrize(("policy", "status"), [("reject_with_429", 429), ("reject_with_503", 503)])
def test_reject_policies(policy: str, status: int) -> None:
    s, ts, _ = full_route(policy)
    with pytest.raises(Rejected) as ei:
        admit(s, "r", "new", now=5)
    r = ei.value
    assert (r.status, r.type) == (status, "queue_full")
    assert r.retry_after is not None and r.retry_after >= 1
    # with 2 waiting, 1 slot, 4 s per job, the new one would be third in line: ~12 s
    assert r.retry_after >= 4
    assert len(s.routes["r"].waiting) == 2
    assert all(t.state == WAITING for t in ts[1:])


def test_drop_oldest_fails_the_oldest_via_its_waker_and_admits_the_new_one() -> None:
    s, ts, wakers = full_route("drop_oldest")
    new = admit(s, "r", "new", now=5)
    oldest = ts[1]
    assert oldest.state == FAILED
    assert oldest.error is not None and (oldest.error.status, oldest.error.type) == (503, "queue_full")
    assert oldest.error.retry_after is not None and oldest.error.retry_after >= 1
    assert wakers[1].calls == [oldest]
    assert wakers[2].calls == []
    assert new.state == WAITING
    assert [t for t in s.routes["r"].waiting.order()] == [ts[2], new]
    assert s.position(oldest, 5) is None


def test_drop_oldest_drops_by_arrival_not_by_strategy_order() -> None:
    s = make({"r": rcfg(max_concurrency=1, max_queue_depth=2, drop_policy="drop_oldest", strategy="priority")},
             [node("a")])
    admit(s, "r", "x", now=0)
    old_low = admit(s, "r", "lo", priority=0, now=1)
    new_high = admit(s, "r", "hi", priority=9, now=2)
    admit(s, "r", "z", priority=1, now=3)
    assert old_low.state == FAILED and new_high.state == WAITING


def test_depth_zero_still_takes_a_free_slot() -> None:
    s = make({"r": rcfg(max_concurrency=1, max_queue_depth=0)}, [node("a")])
    t = admit(s, "r", "k")
    assert t.state == LEASED
    with pytest.raises(Rejected) as ei:
        admit(s, "r", "k")
    assert ei.value.status == 429


def test_max_queued_per_key() -> None:
    s = make({"r": rcfg(max_concurrency=1, max_queued_per_key=2)}, [node("a")])
    admit(s, "r", "A")  # leased: does not count as waiting
    admit(s, "r", "A")
    admit(s, "r", "A")
    with pytest.raises(Rejected) as ei:
        admit(s, "r", "A")
    assert (ei.value.status, ei.value.type) == (429, "queue_full")
    assert ei.value.retry_after is not None and ei.value.retry_after >= 1
    b = admit(s, "r", "B")  # another key is not affected
    assert b.state == WAITING
    assert dict(s.routes["r"].by_key) == {"A": 2, "B": 1}


def test_expire_fails_with_queue_timeout() -> None:
    s = make({"r": rcfg(max_concurrency=1, queue_timeout_sec=10)}, [node("a")])
    admit(s, "r", "k", now=0)
    w = Waker()
    t = admit(s, "r", "k", now=1, on_wake=w)
    later = admit(s, "r", "k", now=5)
    assert s.expire(10.99) == []
    assert s.expire(11.0) == [t]
    assert t.state == FAILED and t.error is not None
    assert (t.error.status, t.error.type) == (503, "queue_timeout")
    assert t.error.retry_after is not None and t.error.retry_after >= 1
    assert w.calls == [t]
    assert s.position(later, 11) == 1
    assert later.state == WAITING


def test_expired_ticket_after_cancel_or_lease_is_ignored() -> None:
    s = make({"r": rcfg(max_concurrency=1, queue_timeout_sec=10)}, [node("a")])
    first = admit(s, "r", "k", now=0)
    t2 = admit(s, "r", "k", now=0)
    t3 = admit(s, "r", "k", now=0)
    assert s.cancel(t3)
    s.release(first.lease, 1, 1.0)  # type: ignore[arg-type]
    s.dispatch(1)
    assert t2.state == LEASED
    assert s.expire(100) == []
    assert t2.state == LEASED and t3.state == DONE


def test_cancel_only_waiting() -> None:
    s = make({"r": rcfg(max_concurrency=1)}, [node("a")])
    t1 = admit(s, "r", "k")
    t2 = admit(s, "r", "k")
    assert not s.cancel(t1)  # leased: cancel does nothing (the caller releases the lease)
    assert s.cancel(t2)
    assert not s.cancel(t2)
    assert len(s.routes["r"].waiting) == 0 and not s.routes["r"].by_key
    finish(s, t1, 1)
    assert s.node_inflight.get("a", 0) == 0


# --- positions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fifo", "fifo_fair_lease", "priority"])
def test_position_one_is_the_next_dispatched(strategy: str) -> None:
    s = make({"r": rcfg(max_concurrency=1, strategy=strategy, queue_timeout_sec=1000)}, [node("a")])
    first = admit(s, "r", "z")
    prio = {"A": 1, "B": 5, "C": 3}
    ts = [admit(s, "r", k, now=i, priority=prio[k]) for i, k in enumerate("AABCBA")]
    positions = {t.seq: s.position(t, 10) for t in ts}
    assert sorted(positions.values()) == list(range(1, 7))
    assert s.positions("r", 10) == positions
    by_pos = sorted(ts, key=lambda t: positions[t.seq])
    assert serve_all(s, "r", first, 10)[1:] == by_pos
    if strategy == "fifo":
        assert by_pos == ts
    elif strategy == "priority":
        assert [t.key for t in by_pos] == ["B", "B", "C", "A", "A", "A"]
    else:
        assert [t.key for t in by_pos] == ["A", "B", "C", "A", "B", "A"]


# --- nodes: caps, choice, standby, requeue ------------------------------------------------------


def test_node_max_concurrency_caps_across_two_routes() -> None:
    s = make({"r1": rcfg(["a"], max_concurrency=2), "r2": rcfg(["a"], max_concurrency=2)}, [node("a", cap=2)])
    t1 = admit(s, "r1", "k", now=0)
    t2 = admit(s, "r2", "k", now=1)
    t3 = admit(s, "r1", "k", now=2)
    t4 = admit(s, "r2", "k", now=3)
    assert [t.state for t in (t1, t2, t3, t4)] == [LEASED, LEASED, WAITING, WAITING]
    assert s.node_inflight["a"] == 2
    finish(s, t2, 4)
    # the freed slot goes to the oldest waiting head across routes (t3 on r1)
    assert t3.state == LEASED and t4.state == WAITING
    assert s.node_inflight["a"] == 2
    assert s.routes["r1"].inflight["a"] == 2
    finish(s, t1, 5)
    assert t4.state == LEASED


def test_a_card_caps_the_leases_of_its_nodes_and_the_slots_a_route_counts() -> None:
    """Two servers on one GPU (docs/CONFIG.md#cards): their routes' slots are 2 + 2, the card's 3."""
    s = make({"r1": rcfg(["a"], max_concurrency=2), "r2": rcfg(["a", "b"], max_concurrency=2)},
             [node("a", card="gpu"), node("b", card="gpu")])
    s.cards.cfg = {"gpu": CardConfig(max_concurrency=3)}
    assert s.live_slots(s.routes["r2"], 0) == 3
    ts = [admit(s, r, "k", now=i) for i, r in enumerate(["r1", "r2", "r2", "r1", "r2"])]
    assert [t.state for t in ts] == [LEASED, LEASED, LEASED, WAITING, WAITING]
    assert s.cards.inflight["gpu"] == 3
    finish(s, ts[1], 5)  # the oldest waiting head across routes takes the card's freed slot
    assert [t.state for t in ts[3:]] == [LEASED, WAITING]
    assert s.cards.inflight["gpu"] == 3


def test_a_lease_ends_on_the_card_it_began_on_whatever_a_reload_did() -> None:
    """A reload moves node a to another card and drops the first: the lease still frees the card
    it was counted on, and the new card counts only what begins after."""
    s = make({"r": rcfg(["a"], max_concurrency=2)}, [node("a", card="old")])
    s.cards.cfg = {"old": CardConfig(max_concurrency=1)}
    t1 = admit(s, "r", "k", now=0)
    s.nodes["a"].cfg = NodeConfig(url=s.nodes["a"].cfg.url, card="new")  # what Runtime._apply_state does
    s.cards.cfg = {"new": CardConfig(max_concurrency=1)}
    t2 = admit(s, "r", "k", now=1)
    assert (t1.state, t2.state) == (LEASED, LEASED) and dict(s.cards.inflight) == {"old": 1, "new": 1}
    finish(s, t1, 2)
    assert dict(s.cards.inflight) == {"new": 1}
    finish(s, t2, 3)
    assert not s.cards.inflight and not s.cards.used


def test_least_in_flight_node_is_chosen() -> None:
    s = make({"r": rcfg(["a", "b"], max_concurrency=3), "other": rcfg(["a"], max_concurrency=3)},
             [node("a"), node("b")])
    # load a through another route: node in-flight counts across routes
    o1 = admit(s, "other", "k")
    o2 = admit(s, "other", "k")
    assert {o1.lease.node, o2.lease.node} == {"a"}  # type: ignore[union-attr]
    t1 = admit(s, "r", "k")
    t2 = admit(s, "r", "k")
    t3 = admit(s, "r", "k")
    assert [t.lease.node for t in (t1, t2, t3)] == ["b", "b", "a"]  # type: ignore[union-attr]
    finish(s, o1, 1)
    finish(s, o2, 1)
    # now a has 1, b has 2
    t4 = admit(s, "r", "k")
    assert t4.lease is not None and t4.lease.node == "a"


def test_standby_only_when_no_primary_can_take_work() -> None:
    p, sb = node("p"), node("s")
    s = make({"r": rcfg(["p"], standby=["s"], max_concurrency=1)}, [p, sb])
    t1 = admit(s, "r", "k")
    assert t1.lease is not None and t1.lease.node == "p"
    # primary merely full: wait for it rather than spill onto the standby
    t2 = admit(s, "r", "k")
    assert t2.state == WAITING
    assert s.node_inflight.get("s", 0) == 0
    # primary unavailable (drained): the standby takes work
    p.drained = True
    s.dispatch(1)
    assert t2.state == LEASED and t2.lease is not None and t2.lease.node == "s"
    # primary back: new work fails back to it, work on the standby stays there
    p.drained = False
    finish(s, t1, 2)
    t3 = admit(s, "r", "k", now=3)
    assert t3.lease is not None and t3.lease.node == "p"
    assert t2.lease.node == "s" and t2.state == LEASED


@pytest.mark.parametrize("how", ["unhealthy", "breaker_open", "drained"])
def test_unavailable_primary_sends_work_to_standby(how: str) -> None:
    hc = HealthConfig(fall=1, rise=1)
    p = NodeState("p", NodeConfig(url="http://10.0.0.1:1", health=hc))
    sb = node("s")
    s = make({"r": rcfg(["p"], standby=["s"], max_concurrency=1)}, [p, sb])
    if how == "unhealthy":
        assert p.record_check(False, 0, None, "down") == ["node_down"]
    elif how == "breaker_open":
        for _ in range(p.breaker_cfg.consecutive_failures):
            p.record_failure(0, "reset")
    else:
        p.drained = True
    t = admit(s, "r", "k", now=0.5)
    assert t.lease is not None and t.lease.node == "s"


def test_no_node_available_means_wait_not_fail() -> None:
    p = node("p")
    p.drained = True
    s = make({"r": rcfg(["p"], max_concurrency=1)}, [p])
    t = admit(s, "r", "k")
    assert t.state == WAITING
    s.dispatch(1)
    assert t.state == WAITING
    p.drained = False
    s.dispatch(2)
    assert t.state == LEASED


def test_requeue_goes_to_the_head_and_avoids_the_failed_node() -> None:
    s = make({"r": rcfg(["a", "b"], max_concurrency=1, strategy="fifo")}, [node("a"), node("b")])
    t1 = admit(s, "r", "k", now=0)
    t2 = admit(s, "r", "k", now=1)
    t3 = admit(s, "r", "k", now=2)
    assert t1.lease.node == "a" and t2.lease.node == "b"  # type: ignore[union-attr]
    lease = t1.lease
    assert lease is not None
    back = s.requeue(lease, 3)
    assert back is t1 and t1.state == WAITING and t1.requeues == 1
    assert lease.released and "a" in t1.avoid
    assert s.position(t1, 3) == 1 and s.position(t3, 3) == 2
    s.dispatch(3)
    # a is free but t1 must not go back there while b may take it; it waits at the head
    assert t1.state == WAITING
    finish(s, t2, 4)
    assert t1.state == LEASED and t1.lease is not None and t1.lease.node == "b"
    assert t3.state == LEASED and t3.lease is not None and t3.lease.node == "a"


@pytest.mark.parametrize("strategy", ["fifo", "fifo_fair_lease", "priority"])
def test_requeue_goes_to_the_head_in_every_strategy(strategy: str) -> None:
    """SPEC §3.4: a re-queued request goes back to the head of its queue, whatever the strategy."""
    s = make({"r": rcfg(["a", "b"], max_concurrency=1, strategy=strategy, queue_timeout_sec=100)},
             [node("a"), node("b")])
    lo = admit(s, "r", "lo", priority=0, now=0)
    busy = admit(s, "r", "busy", priority=0, now=0)
    assert lo.lease.node == "a" and busy.lease.node == "b"  # type: ignore[union-attr]
    hi = admit(s, "r", "hi", priority=5, now=1)  # arrives later, with a higher priority
    s.requeue(lo.lease, 2)  # type: ignore[arg-type]
    assert s.position(lo, 2) == 1 and s.position(hi, 2) == 2
    finish(s, busy, 3)  # b frees up: the re-queued request (avoiding a) takes it
    assert lo.state == LEASED and lo.lease is not None and lo.lease.node == "b"
    assert hi.state == LEASED and hi.lease is not None and hi.lease.node == "a"


def test_requeue_to_the_same_node_when_it_is_the_only_one() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=1)}, [node("a")])
    t1 = admit(s, "r", "k")
    t2 = admit(s, "r", "k")
    s.requeue(t1.lease, 1)  # type: ignore[arg-type]
    s.dispatch(1)
    assert t1.state == LEASED and t1.lease.node == "a"  # type: ignore[union-attr]
    assert t2.state == WAITING


def test_a_lost_node_gets_the_request_back_only_once_seen_alive() -> None:
    """HAProxy's redispatch rule: re-queued because its node was lost, a request waits for that
    node's next passing health check (or any success there) instead of being sent at once."""
    from kilolined.core.config import HealthConfig
    s = make({"r": rcfg(["a"], max_concurrency=2)}, [node("a", health=HealthConfig())])
    t1 = admit(s, "r", "k", now=0)
    s.requeue(t1.lease, 1, lost=True)  # type: ignore[arg-type]
    for now in (1, 5, 100):
        s.dispatch(now)
        assert t1.state == WAITING and s.barred(t1, "a", now)
    s.nodes["a"].record_check(True, 101, 1.0, None)
    s.dispatch(101)
    assert t1.state == LEASED and t1.lease.node == "a"  # type: ignore[union-attr]
    t2 = admit(s, "r", "k", now=102)  # another request is never held back by t1's loss
    assert t2.state == LEASED


def test_a_lost_node_nobody_probes_is_tried_again_after_the_breaker_period() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=1)}, [node("a")])
    open_sec = s.nodes["a"].cfg.breaker.open_sec
    t1 = admit(s, "r", "k", now=0)
    s.requeue(t1.lease, 1, lost=True)  # type: ignore[arg-type]
    s.dispatch(1 + open_sec - 0.01)
    assert t1.state == WAITING
    s.dispatch(1 + open_sec)
    assert t1.state == LEASED


def test_a_node_that_answered_is_only_avoided_never_barred() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=1)}, [node("a")])
    t1 = admit(s, "r", "k", now=0)
    s.requeue(t1.lease, 1)  # type: ignore[arg-type]  # e.g. a 503: the node is alive
    s.dispatch(1)
    assert t1.state == LEASED and not s.barred(t1, "a", 1)


def test_requeue_in_fair_queue_serves_the_requeued_key_next() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=1, strategy="fifo_fair_lease")}, [node("a")])
    a1 = admit(s, "r", "A")
    b1 = admit(s, "r", "B")
    a2 = admit(s, "r", "A")
    s.requeue(a1.lease, 1, avoid_node=False)  # type: ignore[arg-type]
    assert s.position(a1, 1) == 1 and s.position(b1, 1) == 2 and s.position(a2, 1) == 3


def test_release_is_idempotent() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=2)}, [node("a")])
    t1 = admit(s, "r", "k")
    t2 = admit(s, "r", "k")
    l1, l2 = t1.lease, t2.lease
    assert l1 is not None and l2 is not None
    s.release(l1, 1, 1.0)
    s.release(l1, 1, 1.0)
    assert s.routes["r"].inflight["a"] == 1 and s.node_inflight["a"] == 1
    s.release(l2, 1, 1.0)
    assert not s.routes["r"].inflight and not s.node_inflight
    # A served ticket no longer points at its lease: no Ticket ↔ Lease cycle left for the collector.
    assert t1.lease is None and t2.lease is None and l1.ticket is t1


def test_served_tickets_are_not_held_until_their_queue_deadline() -> None:
    # One slot with 3 waiting behind it, while 2000 requests on another route are served at once,
    # each leaving a lazily deleted deadline entry behind.
    s = make({"busy": rcfg(["a"], max_concurrency=1, queue_timeout_sec=600),
              "fast": rcfg(["b"], max_concurrency=1000, queue_timeout_sec=600)}, [node("a"), node("b")])
    first = admit(s, "busy", "k")
    held = [admit(s, "busy", "k") for _ in range(3)]
    for _ in range(2000):
        t = admit(s, "fast", "k", now=1.0)
        s.release(t.lease, 2.0, 1.0)  # type: ignore[arg-type]
    assert s.expire(3.0) == []
    assert len(s._deadlines) <= 256  # compacted, not one entry per served request for 600 s
    assert first.state == LEASED and all(t.state == WAITING for t in held)
    assert s.expire(700.0) == held  # the waiting ones still time out, in order


def test_est_wait_and_retry_after_follow_service_times() -> None:
    s = make({"r": rcfg(["a"], max_concurrency=2, expected_duration_sec=6)}, [node("a")])
    rq = s.routes["r"]
    assert s.est_wait(rq, 3, 0) == pytest.approx(9.0)  # 3 × 6 s ÷ 2 slots
    rq.observe(2.0)  # the first sample replaces the seed
    assert s.est_wait(rq, 3, 0) == pytest.approx(3.0)
    s.nodes["a"].drained = True
    assert s.est_wait(rq, 3, 0) is None  # no live capacity: unknown
    assert s.retry_after(rq, 0) >= 1


# --- property tests -----------------------------------------------------------------------------

KEYS = {"k1": 0, "k2": 2, "k3": 5}  # key -> priority (a key's priority is fixed, as in the config)
NODE_NAMES = ["n1", "n2", "n3"]
CARD = "gpu"  # n1 and n2 share it when the setup has a card (docs/CONFIG.md#cards)
CARDS = [None, CardConfig(), CardConfig(max_concurrency=1), CardConfig(max_concurrency=2),
         CardConfig(capacity=6.0), CardConfig(max_concurrency=3, capacity=10.0)]


@st.composite
def setups(draw: st.DrawFn) -> tuple[dict[str, RouteConfig], list[NodeState], dict[str, CardConfig]]:
    card = draw(st.sampled_from(CARDS))
    nodes = []
    for n in NODE_NAMES:
        nodes.append(NodeState(n, NodeConfig(
            url=f"http://10.0.0.1:{NODE_NAMES.index(n) + 1}",
            max_concurrency=draw(st.one_of(st.none(), st.integers(1, 4))),
            capacity=draw(st.sampled_from([None, 4.0, 10.0, 24.0])),
            health=HealthConfig(fall=1, rise=1),
            breaker=BreakerConfig(consecutive_failures=2, open_sec=3, max_open_sec=12,
                                  slow_start_sec=draw(st.sampled_from([0, 5]))),
            card=CARD if card is not None and n != "n3" else None,
        )))
    layouts = [(["n1"], ["n3"]), (["n1", "n2"], ["n3"]), (["n2"], [])]
    routes = {}
    for i, (prim, sb) in enumerate(layouts):
        routes[f"r{i}"] = RouteConfig(
            path=f"/r{i}", nodes=prim, standby=sb,
            max_concurrency=draw(st.integers(1, 3)),
            max_queue_depth=draw(st.sampled_from([0, 2, 5, 50])),
            queue_timeout_sec=draw(st.sampled_from([2.0, 7.5, 20.0])),
            drop_policy=draw(st.sampled_from(["reject_with_429", "reject_with_503", "drop_oldest"])),
            strategy=draw(st.sampled_from(["fifo", "fifo_fair_lease", "priority"])),
            max_queued_per_key=draw(st.sampled_from([None, None, 2, 10])),
            retry_on_failover=1,
            cost=draw(st.sampled_from([None, RequestCostConfig(base=1)])),
            max_bypass=draw(st.sampled_from([0, 1, 8])),
        )
    return routes, nodes, {} if card is None else {CARD: card}


_OP_ARGS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "admit": st.tuples(st.just("admit"), st.integers(0, 2), st.sampled_from(sorted(KEYS)),
                       st.sampled_from([0.0, 0.5, 2.0, 3.5, 8.0, 30.0])),
    "cancel": st.tuples(st.just("cancel"), st.integers(0, 10_000)),
    "advance": st.tuples(st.just("advance"), st.floats(0, 4, allow_nan=False)),
    "complete": st.tuples(st.just("complete"), st.integers(0, 10_000), st.booleans()),
    "requeue": st.tuples(st.just("requeue"), st.integers(0, 10_000)),
    "release_again": st.tuples(st.just("release_again"), st.integers(0, 10_000)),
    "health": st.tuples(st.just("health"), st.sampled_from(NODE_NAMES), st.booleans()),
    "drain": st.tuples(st.just("drain"), st.sampled_from(NODE_NAMES), st.booleans()),
}
# Admissions and completions weighted up so that queues build and drain.
_OP_KINDS = ["admit"] * 6 + ["complete"] * 3 + ["requeue", "requeue", "cancel", "advance", "advance",
                                                 "release_again", "health", "drain"]
OPS = st.sampled_from(_OP_KINDS).flatmap(lambda k: _OP_ARGS[k])


class CheckedScheduler(Scheduler):
    """Checks the capacity rule at the moment each lease is made (several may be made at once)."""

    def _lease(self, rq: RouteQueue, t: Ticket, node: str, now: float) -> Any:
        ns = self.nodes[node]
        if ns.cfg.capacity is not None:
            held = self.capacity_used.get(node, 0.0)
            # Within the (ramped) capacity, or the ramp's one request on a node that holds none.
            assert held + t.cost <= ramped_capacity(ns, now) + EPS or (held <= EPS and t.cost <= ns.cfg.capacity)
        return super()._lease(rq, t, node, now)


class Model:
    """Drives a Scheduler like the Runtime does and checks its invariants after every step."""

    def __init__(self, routes: dict[str, RouteConfig], nodes: list[NodeState],
                 cards: dict[str, CardConfig] | None = None):
        self.s = CheckedScheduler()
        self.cards = cards or {}
        self.s.cards.cfg = dict(self.cards)
        for ns in nodes:
            self.s.nodes[ns.name] = ns
        for name, cfg in routes.items():
            self.s.routes[name] = RouteQueue(name, cfg)
        self.now = 0.0
        self.tickets: list[Ticket] = []
        self.outcomes: dict[int, list[str]] = {}
        self.woken: Counter[int] = Counter()
        self.wake_order: list[Ticket] = []
        self.seen_leases: set[int] = set()
        self.old_leases: list[Any] = []
        self.first_leased: set[int] = set()
        self.prev_state: dict[int, str] = {}

    # -- the waker ---------------------------------------------------------------------------
    def on_wake(self, t: Ticket) -> None:
        self.woken[t.seq] += 1
        self.wake_order.append(t)

    def limit(self, node: str) -> float | None:
        """The most ``node`` can hold: its capacity, or its card's when that is smaller."""
        ncfg = self.s.nodes[node].cfg
        card = self.cards.get(ncfg.card) if ncfg.card is not None else None
        caps = [c for c in (ncfg.capacity, card.capacity if card is not None else None) if c is not None]
        return min(caps) if caps else None

    def leased(self) -> list[Ticket]:
        return [t for t in self.tickets if t.state == LEASED]

    def waiting(self) -> list[Ticket]:
        return [t for t in self.tickets if t.state == WAITING]

    # -- operations --------------------------------------------------------------------------
    def apply(self, op: tuple[Any, ...]) -> None:
        s, now = self.s, self.now
        kind = op[0]
        before = {t.seq: t.state for t in self.tickets}
        before_order = {r: list(rq.waiting.order()) for r, rq in s.routes.items()}
        self.wake_order = []
        woken_before = Counter(self.woken)
        if kind == "admit":
            route = f"r{op[1]}"
            rq = s.routes[route]
            depth, by_key = len(rq.waiting), rq.by_key[op[2]]
            cost = op[3] if rq.cfg.cost is not None else 0.0
            try:
                t = s.admit(route, op[2], KEYS[op[2]], now, on_wake=self.on_wake, cost=cost)
            except Rejected as r:
                caps = [self.limit(n) for n in rq.all_nodes]
                if r.type == "exceeds_capacity":
                    assert r.status == 422 and None not in caps and cost > max(caps)  # type: ignore[type-var]
                    return
                assert None in caps or cost <= max(caps), "a request no node can hold was queued"  # type: ignore[type-var]
                assert r.type == "queue_full" and r.retry_after is not None and r.retry_after >= 1
                cfg = rq.cfg
                per_key = cfg.max_queued_per_key is not None and by_key >= cfg.max_queued_per_key
                # drop_oldest rejects only when there is nobody to drop (max_queue_depth 0)
                full = depth >= cfg.max_queue_depth and (cfg.drop_policy != "drop_oldest" or depth == 0)
                assert per_key or full, "rejected although there was room"
                assert r.status == (429 if per_key or cfg.drop_policy == "reject_with_429" else 503)
            else:
                self.tickets.append(t)
                self.outcomes[t.seq] = []
                assert t.state in (WAITING, LEASED)
        elif kind == "cancel":
            if self.tickets:
                t = self.tickets[op[1] % len(self.tickets)]
                was = t.state
                ok = s.cancel(t)
                assert ok == (was == WAITING)
                if ok:
                    assert t.state == DONE
                    self.outcomes[t.seq].append("cancelled")
        elif kind == "advance":
            self.now = now = now + op[1]
            waiting_before = {t.seq: t.deadline for t in self.waiting()}
            expired = s.expire(now)
            for t in expired:
                assert t.seq in waiting_before and waiting_before[t.seq] <= now
                assert t.error is not None and (t.error.status, t.error.type) == (503, "queue_timeout")
            s.dispatch(now)
            for t in self.waiting():
                assert t.deadline > now, "a ticket past its queue timeout is still waiting"
        elif kind == "complete":
            live = self.leased()
            if live:
                t = live[op[1] % len(live)]
                lease = t.lease
                assert lease is not None
                ns = s.nodes[lease.node]
                if op[2]:
                    ns.record_success(now, trial=lease.trial)
                else:
                    ns.record_failure(now, "boom", trial=lease.trial)
                s.release(lease, now, service_time=1.0 if op[2] else None)
                assert t.state == DONE
                self.outcomes[t.seq].append("released")
                self.old_leases.append(lease)
                s.dispatch(now)
                self.check_prefix(before_order, before)
        elif kind == "requeue":
            live = [t for t in self.leased() if t.requeues < 3]
            if live:
                t = live[op[1] % len(live)]
                lease = t.lease
                assert lease is not None
                s.nodes[lease.node].record_failure(now, "reset", trial=lease.trial)
                s.requeue(lease, now)
                self.old_leases.append(lease)
                assert t.state == WAITING and lease.node in t.avoid
                assert s.position(t, now) == 1  # back at the head, whatever the strategy
                s.dispatch(now)
        elif kind == "release_again":
            if self.old_leases:
                lease = self.old_leases[op[1] % len(self.old_leases)]
                s.release(lease, now, service_time=1.0)
        elif kind == "health":
            s.nodes[op[1]].record_check(op[2], now, 1.0, None if op[2] else "down")
            s.dispatch(now)
            self.check_prefix(before_order, before)
        elif kind == "drain":
            s.nodes[op[1]].drained = op[2]
            s.dispatch(now)
            self.check_prefix(before_order, before)
        self.check(before, woken_before)

    def check_prefix(self, before_order: dict[str, list[Ticket]], before: dict[int, str]) -> None:
        """With the clock still, the tickets that leave a queue for a slot are its first positions
        (unless costs let a later one fit first: backfill)."""
        for route, order in before_order.items():
            if self.s.costed(self.s.routes[route]):
                continue
            got = [t for t in self.wake_order if t.route == route and t.state == LEASED
                   and before.get(t.seq) == WAITING]
            assert got == order[: len(got)], f"{route}: dispatched out of position order"

    # -- invariants --------------------------------------------------------------------------
    def check(self, before: dict[int, str], woken_before: Counter[int]) -> None:
        s, now = self.s, self.now
        live = self.leased()
        # every live lease is counted exactly once, per route/node and per node; never over the caps
        per_route: Counter[tuple[str, str]] = Counter()
        per_node: Counter[str] = Counter()
        for t in live:
            lease = t.lease
            assert lease is not None and not lease.released and lease.ticket is t
            per_route[(lease.route, lease.node)] += 1
            per_node[lease.node] += 1
        for name, rq in s.routes.items():
            assert {n: c for n, c in rq.inflight.items() if c} == {
                n: c for (r, n), c in per_route.items() if r == name}
            assert all(c <= rq.cfg.max_concurrency for c in rq.inflight.values())
        assert {n: c for n, c in s.node_inflight.items() if c} == dict(per_node)
        for n, c in per_node.items():
            cap = s.nodes[n].cfg.max_concurrency
            assert cap is None or c <= cap
        # in-flight cost: counted exactly, never above a node's capacity
        node_cost: Counter[str] = Counter()
        route_cost: Counter[str] = Counter()
        for t in live:
            assert t.lease is not None and t.lease.cost == t.cost
            node_cost[t.lease.node] += t.cost
            route_cost[t.lease.route] += t.cost
        for n in s.nodes:
            assert abs(s.capacity_used.get(n, 0.0) - node_cost[n]) < 1e-6
            capacity = s.nodes[n].cfg.capacity
            assert capacity is None or node_cost[n] <= capacity + EPS, "in-flight cost above capacity"
        for name, rq in s.routes.items():
            assert abs(rq.capacity_used - route_cost[name]) < 1e-6
        # cards: the leases on all of a card's nodes, counted exactly, never over its slots or capacity
        card_leases: Counter[str] = Counter()
        card_cost: Counter[str] = Counter()
        for t in live:
            assert t.lease is not None
            card = s.nodes[t.lease.node].cfg.card
            if card is not None:
                card_leases[card] += 1
                card_cost[card] += t.cost
        assert {c: n for c, n in s.cards.inflight.items() if n} == dict(card_leases)
        for c, cfg in self.cards.items():
            assert abs(s.cards.used.get(c, 0.0) - card_cost[c]) < 1e-6
            assert cfg.max_concurrency is None or card_leases[c] <= cfg.max_concurrency, "card over its slots"
            assert cfg.capacity is None or card_cost[c] <= cfg.capacity + EPS, "card over its capacity"
            assert all(t.bypassed <= rq.cfg.max_bypass for t in self.tickets if t.route == name)
        # waiting tickets: each in exactly one queue, exactly once; counters agree
        for name, rq in s.routes.items():
            order = list(rq.waiting.order())
            assert len(order) == len(rq.waiting) == len({t.seq for t in order})
            mine = [t for t in self.tickets if t.state == WAITING and t.route == name]
            assert {t.seq for t in order} == {t.seq for t in mine}
            assert {k: c for k, c in rq.by_key.items() if c} == dict(Counter(t.key for t in mine))
            assert sorted(s.positions(name, now).values()) == list(range(1, len(order) + 1))
        # state transitions
        for t in self.tickets:
            prev = before.get(t.seq)
            assert t.state in (WAITING, LEASED, DONE, FAILED)
            if prev in (DONE, FAILED):
                assert t.state == prev, "a finished ticket came back"
            if t.state == FAILED and prev != FAILED:
                assert prev == WAITING or prev is None
                self.outcomes[t.seq].append("failed")
                assert self.woken[t.seq] > woken_before[t.seq], "failed ticket not woken"
            if t.state == LEASED and prev == WAITING:
                assert self.woken[t.seq] > woken_before[t.seq], "leased ticket not woken"
        # new leases: within effective slots, standby only when no primary can take work, FIFO per key
        for t in live:
            lease = t.lease
            assert lease is not None
            if id(lease) in self.seen_leases:
                continue
            self.seen_leases.add(id(lease))
            rq = s.routes[lease.route]
            ns = s.nodes[lease.node]
            assert rq.inflight[lease.node] <= ns.effective(rq.cfg.max_concurrency, now)
            if ns.cfg.max_concurrency is not None:
                assert s.node_inflight[lease.node] <= ns.effective(ns.cfg.max_concurrency, now)
            if lease.node in rq.cfg.standby and not t.avoid:
                assert not any(s.nodes[p].available(now) and s.could_hold(s.nodes[p], t.cost)
                               for p in rq.cfg.nodes), "standby used while a primary could"
            if t.seq not in self.first_leased and not s.costed(rq):
                self.first_leased.add(t.seq)
                older = [o for o in self.tickets if o.route == t.route and o.key == t.key and o.seq < t.seq
                         and o.state == WAITING and o.seq not in self.first_leased]
                assert not older, "FIFO within a key broken"

    def finish(self) -> None:
        """Complete everything: every ticket must end exactly once and every counter return to 0."""
        s = self.s
        for _ in range(10_000):
            live = self.leased()
            if not live:
                break
            t = live[0]
            lease = t.lease
            assert lease is not None
            s.nodes[lease.node].record_success(self.now, trial=lease.trial)
            before = {x.seq: x.state for x in self.tickets}
            wb = Counter(self.woken)
            s.release(lease, self.now, 1.0)
            self.outcomes[t.seq].append("released")
            s.dispatch(self.now)
            self.check(before, wb)
        for t in self.waiting():
            assert s.cancel(t)
            self.outcomes[t.seq].append("cancelled")
        for rq in s.routes.values():
            assert len(rq.waiting) == 0 and not +rq.by_key and not +rq.inflight
        assert not +s.node_inflight
        assert not +s.cards.inflight and not s.cards.used, "a card still counts a released lease"
        for t in self.tickets:
            assert t.state in (DONE, FAILED)
            assert len(self.outcomes[t.seq]) == 1, (t, self.outcomes[t.seq])
            assert (self.outcomes[t.seq][0] == "failed") == (t.state == FAILED)
            if t.lease is not None:
                assert t.lease.released


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), ops=st.lists(OPS, min_size=30, max_size=200))
def test_scheduler_invariants(setup: tuple[dict[str, RouteConfig], list[NodeState], dict[str, CardConfig]],
                              ops: list[tuple[Any, ...]]) -> None:
    m = Model(*setup)
    for op in ops:
        m.apply(op)
    m.finish()


@settings(max_examples=150, deadline=None)
@given(strategy=st.sampled_from(["fifo", "fifo_fair_lease", "priority"]),
       arrivals=st.lists(st.tuples(st.sampled_from("ABC"), st.floats(0, 3)), min_size=1, max_size=30),
       slots=st.integers(1, 3))
def test_fifo_within_a_key_and_nothing_lost(strategy: str, arrivals: list[tuple[str, float]], slots: int) -> None:
    """Random arrivals on one route: each key's requests are served in their arrival order, all served once."""
    s = make({"r": rcfg(["a"], max_concurrency=slots, strategy=strategy, max_queue_depth=1000,
                        queue_timeout_sec=1e6)}, [node("a")])
    prio = {"A": 0, "B": 1, "C": 2}
    now = 0.0
    tickets = []
    for key, dt in arrivals:
        now += dt
        tickets.append(s.admit("r", key, prio[key], now))
    served: list[Ticket] = [t for t in tickets if t.state == LEASED]
    while True:
        live = [t for t in tickets if t.state == LEASED]
        if not live:
            break
        now += 0.5
        s.release(live[0].lease, now, 0.5)  # type: ignore[arg-type]
        before = {t.seq for t in served}
        s.dispatch(now)
        served += [t for t in tickets if t.state == LEASED and t.seq not in before]
    assert len(served) == len(tickets) == len({t.seq for t in served})
    for k in "ABC":
        seqs = [t.seq for t in served if t.key == k]
        assert seqs == sorted(seqs)
    assert not +s.node_inflight and len(s.routes["r"].waiting) == 0


# --- cost and capacity (docs/CONFIG.md, "Cost and capacity") ------------------------------------


def cnode(name: str, capacity: float | None, **kw: Any) -> NodeState:
    return node(name, capacity=capacity, **kw)


def crcfg(nodes: list[str] | None = None, **kw: Any) -> RouteConfig:
    kw.setdefault("max_concurrency", 8)
    kw.setdefault("cost", RequestCostConfig(base=1))
    return rcfg(nodes, **kw)


def test_a_node_takes_requests_while_their_costs_fit() -> None:
    s = make({"r": crcfg(["a"])}, [cnode("a", 10)])
    t1, t2, t3 = (admit(s, "r", "k", cost=c) for c in (6, 5, 5))
    assert (t1.state, t2.state, t3.state) == (LEASED, WAITING, WAITING)
    assert s.capacity_used["a"] == 6 and s.routes["r"].capacity_used == 6
    finish(s, t1, 1.0)
    assert (t2.state, t3.state) == (LEASED, LEASED)  # 5 + 5 fit in 10
    assert s.capacity_used["a"] == 10


def test_exceeds_capacity_is_refused_at_once_naming_cost_and_capacity() -> None:
    s = make({"r": crcfg(["a"], standby=["b"])}, [cnode("a", 10), cnode("b", 22)])
    with pytest.raises(Rejected) as e:
        admit(s, "r", "k", cost=23)
    assert (e.value.status, e.value.type) == (422, "exceeds_capacity")
    assert "23" in e.value.message and "22" in e.value.message
    assert admit(s, "r", "k", cost=22).state == LEASED  # the standby can hold it: a too-small primary is skipped


def test_a_node_without_capacity_never_refuses_by_cost() -> None:
    s = make({"r": crcfg(["a", "b"])}, [cnode("a", 10), cnode("b", None)])
    t = admit(s, "r", "k", cost=1000)
    assert t.state == LEASED and t.lease is not None and t.lease.node == "b"


def test_routes_without_cost_ignore_capacity() -> None:
    s = make({"c": crcfg(["a"]), "free": rcfg(["a"], max_concurrency=4)}, [cnode("a", 10)])
    admit(s, "c", "k", cost=10)
    assert all(admit(s, "free", "k").state == LEASED for _ in range(4))


def test_backfill_lets_a_small_request_pass_a_head_that_does_not_fit() -> None:
    s = make({"r": crcfg(["a"], strategy="fifo")}, [cnode("a", 10)])
    first = admit(s, "r", "k", cost=6)
    big = admit(s, "r", "k", cost=8)
    small = admit(s, "r", "k", cost=3)
    assert (first.state, big.state, small.state) == (LEASED, WAITING, LEASED)
    assert big.bypassed == 1


def test_a_head_passed_over_max_bypass_times_is_not_passed_again() -> None:
    s = make({"r": crcfg(["a"], strategy="fifo", max_bypass=2)}, [cnode("a", 10)])
    running = admit(s, "r", "k", cost=6)
    big = admit(s, "r", "k", cost=8)
    smalls = [admit(s, "r", "k", cost=1) for _ in range(5)]
    assert [t.state for t in smalls] == [LEASED, LEASED, WAITING, WAITING, WAITING]
    assert big.bypassed == 2
    for t in smalls[:2]:
        finish(s, t, 1.0)
    assert [t.state for t in smalls[2:]] == [WAITING] * 3  # room for a 1, but the node waits for the head
    finish(s, running, 2.0)
    assert big.state == LEASED  # 8 fits now; then the smalls backfill again
    assert [t.state for t in smalls[2:]] == [LEASED, LEASED, WAITING]


def test_a_held_head_does_not_block_nodes_that_could_never_hold_it() -> None:
    s = make({"r": crcfg(["a", "b"], strategy="fifo", max_bypass=0)}, [cnode("a", 10), cnode("b", 4)])
    admit(s, "r", "k", cost=6)  # on a
    big = admit(s, "r", "k", cost=8)
    small = admit(s, "r", "k", cost=2)
    assert big.state == WAITING
    assert small.state == LEASED and small.lease is not None and small.lease.node == "b"


def test_capacity_ramps_during_slow_start() -> None:
    ns = cnode("a", 20, health=HealthConfig(fall=1, rise=1), breaker=BreakerConfig(slow_start_sec=10))
    s = make({"r": crcfg(["a"])}, [ns])
    ns.record_check(False, 0.0, None, "down")
    ns.record_check(True, 0.0, 1.0, None)  # recovered at t=0
    assert ramped_capacity(ns, 5.0) == 10
    t1 = admit(s, "r", "k", 5.0, cost=15)
    assert t1.state == LEASED  # a node holding nothing takes one request that fits its full capacity
    t2 = admit(s, "r", "k", 5.0, cost=1)
    assert t2.state == WAITING  # 16 > 10 while ramping
    s.dispatch(9.5)
    assert t2.state == LEASED  # 16 ≤ 19 at 95 %


def test_release_returns_capacity_exactly() -> None:
    s = make({"r": crcfg(["a"], max_concurrency=10)}, [cnode("a", 1)])
    ts = [admit(s, "r", "k", cost=0.1) for _ in range(10)]
    assert all(t.state == LEASED for t in ts)
    for t in ts:
        finish(s, t, 1.0)
    assert "a" not in s.capacity_used and s.routes["r"].capacity_used == 0


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.sampled_from([0.5, 1.0, 2.0, 5.0, 9.0, 10.0]), min_size=1, max_size=40),
       max_bypass=st.integers(0, 4), strategy=st.sampled_from(["fifo", "fifo_fair_lease"]),
       finish_order=st.randoms(use_true_random=False))
def test_a_passed_over_head_waits_at_most_max_bypass_dispatches(costs: list[float], max_bypass: int,
                                                                strategy: str, finish_order: Any) -> None:
    """One node of capacity 10, mixed costs, completions in random order: every lease made while
    another ticket was the head counts against that head; no head is passed more than max_bypass
    times, capacity is never exceeded, and everything is served."""
    s = make({"r": crcfg(["a"], strategy=strategy, max_bypass=max_bypass, max_queue_depth=1000,
                         queue_timeout_sec=1e6)}, [cnode("a", 10)])
    rq = s.routes["r"]
    passes: Counter[int] = Counter()
    head: list[Ticket | None] = [None]  # the head just before each lease

    def on_wake(t: Ticket) -> None:
        # Called inside dispatch right after the lease: the queue is already as it left it.
        h = head[0]
        if h is not None and t is not h:
            passes[h.seq] += 1
        head[0] = rq.waiting.peek()

    def step(fn: Any) -> None:
        head[0] = rq.waiting.peek()
        fn()
        assert s.capacity_used.get("a", 0.0) <= 10 + EPS

    tickets: list[Ticket] = []
    for i, c in enumerate(costs):
        step(lambda c=c, i=i: tickets.append(s.admit("r", f"k{i % 3}", 0, 0.0, cost=c, on_wake=on_wake)))
    for _ in range(10 * len(costs)):
        live = [t for t in tickets if t.state == LEASED]
        if not live:
            break
        t = finish_order.choice(live)
        step(lambda t=t: finish(s, t, 0.0))
    assert all(t.state == DONE for t in tickets)
    assert max(passes.values(), default=0) <= max_bypass
