"""The overflow tier as pure logic (kilolined.scheduling.queue, docs/CONFIG.md#overflow): an overflow
node takes a request only when no primary or standby can within ``when_wait_sec`` (it has
waited that long, or its place in the queue says it would), or none is up; never while a
primary is free. Driven with a hand-made clock."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, WAITING, RouteQueue, Scheduler, Ticket, overflow_due


def sched(when: float = 30, cloud_models: dict[str, str] | None = None, **route: Any) -> Scheduler:
    s = Scheduler()
    s.nodes["gpu"] = NodeState("gpu", NodeConfig(url="http://10.0.0.1:8080"))
    rewrite = {"model": cloud_models} if cloud_models else None
    s.nodes["cloud"] = NodeState("cloud", NodeConfig(url="https://api.example.com", rewrite=rewrite))
    cfg = RouteConfig(path="/v1", kind="openai", nodes=["gpu"], max_concurrency=1,
                      overflow={"nodes": ["cloud"], "when_wait_sec": when}, **route)
    s.routes["llm"] = RouteQueue("llm", cfg)
    return s


def admit(s: Scheduler, now: float, model: str | None = None) -> Ticket:
    return s.admit("llm", "k", 0, now, model=model)


def node_of(t: Ticket) -> str | None:
    return t.lease.node if t.lease is not None else None


def test_the_rule() -> None:
    assert not overflow_due(0, None, 30)  # nothing measured, nothing waited: the primary's turn
    assert overflow_due(30, None, 30)
    assert overflow_due(0, 31, 30) and not overflow_due(0, 30, 30)


def test_a_free_primary_always_takes_it() -> None:
    s = sched(when=0)
    for i in range(5):
        t = admit(s, float(i))
        assert node_of(t) == "gpu"
        assert t.lease is not None
        s.release(t.lease, float(i) + 0.5, service_time=0.5)


def test_a_busy_primary_is_waited_for_until_when_wait_sec() -> None:
    s = sched(when=30)
    first = admit(s, 0.0)
    second = admit(s, 1.0)
    assert node_of(first) == "gpu" and second.state == WAITING
    s.dispatch(30.9)
    assert second.state == WAITING
    s.dispatch(31.0)  # waited 30 s
    assert second.state == LEASED and node_of(second) == "cloud"


def test_a_primary_freed_in_time_gets_it_not_the_overflow() -> None:
    s = sched(when=30)
    first = admit(s, 0.0)
    second = admit(s, 1.0)
    assert first.lease is not None
    s.release(first.lease, 10.0, service_time=10.0)
    s.dispatch(10.0)
    assert node_of(second) == "gpu"


def test_the_estimate_sends_it_at_once_when_it_says_the_wait_is_longer() -> None:
    s = sched(when=30, expected_duration_sec=60)  # one slot, 60 s a request: the next waits ~60 s
    assert node_of(admit(s, 0.0)) == "gpu"
    assert node_of(admit(s, 0.0)) == "cloud"


def test_only_the_requests_beyond_the_bound_overflow() -> None:
    """Service 10 s on one slot, bound 25 s: places 1 and 2 wait for the primary (10, 20 s),
    place 3 (30 s) and beyond go to the overflow as its slots allow."""
    s = sched(when=25, expected_duration_sec=10)
    running = admit(s, 0.0)
    queued = [admit(s, 0.0) for _ in range(3)]
    assert node_of(running) == "gpu"
    # the third waiting one went to the cloud (one slot there), the first two wait for the gpu
    assert [t.state for t in queued] == [WAITING, WAITING, LEASED] and node_of(queued[2]) == "cloud"


def test_with_no_primary_up_the_overflow_takes_it_at_once() -> None:
    s = sched(when=30)
    s.nodes["gpu"].drained = True
    assert node_of(admit(s, 0.0)) == "cloud"


def test_the_overflow_takes_only_the_names_its_rewrite_maps() -> None:
    s = sched(when=0, cloud_models={"qwen": "provider/qwen-72b"})
    s.nodes["gpu"].drained = True
    assert node_of(admit(s, 0.0, "qwen")) == "cloud"
    other = admit(s, 0.0, "llama")  # the gpu (drained) would take any model: it waits for it
    assert other.state == WAITING


def test_max_concurrency_holds_on_the_overflow_node() -> None:
    s = sched(when=0)
    s.nodes["gpu"].drained = True
    a, b = admit(s, 0.0), admit(s, 0.0)
    assert node_of(a) == "cloud" and b.state == WAITING


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "release", "tick"]), st.floats(0, 20)), max_size=40),
       st.sampled_from([None, 5.0, 60.0]), st.floats(0, 30))
def test_the_overflow_never_takes_what_a_free_primary_could(steps: list[tuple[str, float]],
                                                            expected: float | None, when: float) -> None:
    """Whatever arrives, ends and waits: a request given to the overflow node found the primary
    full (2 slots here), and had waited ``when`` or had an estimate that said it would."""
    s = sched(when=when, expected_duration_sec=expected)
    s.routes["llm"].cfg = s.routes["llm"].cfg.model_copy(update={"max_concurrency": 2})
    now, running, on_cloud = 0.0, [], set()
    for op, dt in steps:
        now += dt
        if op == "admit":
            running.append(admit(s, now))
        elif op == "release":
            held = [t for t in running if t.lease is not None]
            if held:
                lease = held[0].lease
                assert lease is not None
                s.release(lease, now, service_time=dt)
                running.remove(held[0])
                s.dispatch(now)
        else:
            s.dispatch(now)
        for t in running:
            if node_of(t) != "cloud" or id(t) in on_cloud:
                continue
            on_cloud.add(id(t))  # granted in this step
            assert s.routes["llm"].inflight["gpu"] == 2
            # it waited the bound, or there was an estimate to say it would
            assert now - t.enqueued_at >= when or s.routes["llm"].mean_service is not None
