"""kilolined.scheduling.nodes: breaker, health, slow start and drain as pure logic with a hand-made clock
(SPEC §3.4)."""

from __future__ import annotations

import pytest

from kilolined.core.config import BreakerConfig, HealthConfig, NodeConfig
from kilolined.scheduling.nodes import CLOSED, HALF_OPEN, OPEN, NodeState


def mk(health: HealthConfig | None = None, **breaker: float) -> NodeState:
    b = {"consecutive_failures": 3, "open_sec": 10, "max_open_sec": 35, "slow_start_sec": 40}
    b.update(breaker)
    return NodeState("gpu1", NodeConfig(url="http://10.0.0.1:8188", health=health, breaker=BreakerConfig(**b)))


def trip(ns: NodeState, now: float) -> list[str]:
    events: list[str] = []
    for _ in range(ns.breaker_cfg.consecutive_failures):
        events += ns.record_failure(now, "connection reset")
    return events


# --- breaker ------------------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures() -> None:
    ns = mk()
    assert ns.available(0)
    assert ns.record_failure(0, "reset") == []
    assert ns.record_failure(0, "reset") == []
    assert ns.breaker_state(0) == CLOSED and ns.available(0)
    assert ns.record_failure(0, "reset") == ["breaker_open"]
    assert ns.breaker_state(0) == OPEN
    assert not ns.available(0)
    assert ns.last_error == "reset"


def test_success_resets_the_failure_count() -> None:
    ns = mk()
    ns.record_failure(0, "x")
    ns.record_failure(0, "x")
    ns.record_success(0)
    ns.record_failure(0, "x")
    ns.record_failure(0, "x")
    assert ns.breaker_state(0) == CLOSED
    assert ns.record_failure(0, "x") == ["breaker_open"]


def test_open_lasts_open_sec_then_half_open() -> None:
    ns = mk(open_sec=10)
    trip(ns, 100)
    assert not ns.available(109.99)
    assert ns.breaker_state(109.99) == OPEN
    assert ns.breaker_state(110) == HALF_OPEN
    assert ns.available(110)


def test_failures_while_open_do_not_extend_it() -> None:
    ns = mk(open_sec=10)
    trip(ns, 0)
    assert ns.record_failure(5, "late straggler") == []
    assert ns.breaker_state(10) == HALF_OPEN


def test_half_open_allows_exactly_one_trial() -> None:
    ns = mk(open_sec=10)
    trip(ns, 0)
    assert ns.available(10)
    assert ns.on_dispatch(10) is True  # this request is the trial
    assert not ns.available(10)  # nothing else while the trial runs
    assert not ns.available(11)
    assert ns.breaker_state(11) == HALF_OPEN


def test_trial_success_closes() -> None:
    ns = mk(open_sec=10)
    trip(ns, 0)
    assert ns.on_dispatch(10)
    assert ns.record_success(12, trial=True) == ["breaker_closed"]
    assert ns.breaker_state(12) == CLOSED and ns.available(12)
    # closed again: the next dispatch is not a trial
    assert ns.on_dispatch(12) is False


def test_non_trial_success_while_half_open_does_not_close() -> None:
    ns = mk(open_sec=10)
    trip(ns, 0)
    ns.on_dispatch(10)
    assert ns.record_success(11, trial=False) == []
    assert ns.breaker_state(11) == HALF_OPEN
    assert not ns.available(11)


def test_trial_failure_reopens_with_doubled_period_capped() -> None:
    ns = mk(open_sec=10, max_open_sec=35)
    trip(ns, 0)
    assert ns.open_period == 10
    # trial 1 fails at 10: open for 20
    assert ns.on_dispatch(10)
    assert ns.record_failure(10, "reset", trial=True) == ["breaker_open"]
    assert ns.breaker_state(29.9) == OPEN
    assert ns.breaker_state(30) == HALF_OPEN
    # trial 2 fails at 30: 40 capped at 35
    assert ns.on_dispatch(30)
    assert ns.record_failure(30, "reset", trial=True) == ["breaker_open"]
    assert ns.breaker_state(64.9) == OPEN
    assert ns.breaker_state(65) == HALF_OPEN
    # trial 3 fails: stays at the cap
    assert ns.on_dispatch(65)
    ns.record_failure(65, "reset", trial=True)
    assert ns.breaker_state(99.9) == OPEN and ns.breaker_state(100) == HALF_OPEN
    # success closes; the next trip starts from open_sec again
    ns.on_dispatch(100)
    ns.record_success(100, trial=True)
    trip(ns, 200)
    assert ns.breaker_state(209.9) == OPEN and ns.breaker_state(210) == HALF_OPEN


def test_trial_without_verdict_can_be_given_back() -> None:
    """A cancelled trial (scheduler.release clears the flag) lets another trial run."""
    ns = mk(open_sec=1)
    trip(ns, 0)
    ns.on_dispatch(1)
    assert not ns.available(1)
    ns.trial_in_flight = False
    assert ns.available(1)


def test_health_check_can_be_the_half_open_trial() -> None:
    ns = mk(HealthConfig(fall=3, rise=2), open_sec=5)
    trip(ns, 0)
    assert ns.record_check(True, 2, 3.0, None) == []  # still open: no trial yet
    assert ns.breaker_state(2) == OPEN
    assert ns.record_check(True, 5, 3.0, None) == ["breaker_closed"]
    assert ns.breaker_state(5) == CLOSED


def test_failed_health_check_while_half_open_reopens() -> None:
    ns = mk(HealthConfig(fall=3, rise=2), open_sec=5)
    trip(ns, 0)
    assert ns.record_check(False, 5, None, "timeout") == ["breaker_open"]
    assert ns.breaker_state(5) == OPEN
    assert ns.breaker_state(14.9) == OPEN and ns.breaker_state(15) == HALF_OPEN  # doubled to 10


# --- health -------------------------------------------------------------------------------------


def test_health_fall_and_rise() -> None:
    ns = mk(HealthConfig(fall=3, rise=2))
    assert ns.record_check(False, 1, None, "refused") == []
    assert ns.record_check(False, 2, None, "refused") == []
    assert ns.healthy and ns.available(2)
    assert ns.record_check(False, 3, None, "refused") == ["node_down"]
    assert not ns.healthy and not ns.available(3)
    assert ns.last_error == "refused"
    assert ns.record_check(True, 4, 5.0, None) == []
    assert not ns.available(4)
    assert ns.record_check(True, 5, 5.0, None) == ["node_up"]
    assert ns.available(5)
    assert ns.last_check_ms == 5.0
    assert ns.snapshot(5)["health"] == "up"


def test_health_fall_counts_only_consecutive_failures() -> None:
    ns = mk(HealthConfig(fall=2, rise=2))
    ns.record_check(False, 1, None, "x")
    ns.record_check(True, 2, 1.0, None)
    assert ns.record_check(False, 3, None, "x") == []
    assert ns.healthy
    # and rise only consecutive successes
    ns.record_check(False, 4, None, "x")
    assert not ns.healthy
    ns.record_check(True, 5, 1.0, None)
    ns.record_check(False, 6, None, "x")
    assert ns.record_check(True, 7, 1.0, None) == []
    assert ns.record_check(True, 8, 1.0, None) == ["node_up"]


def test_node_without_health_config_ignores_checks() -> None:
    ns = mk()
    assert ns.record_check(False, 1, None, "x") == []
    assert ns.healthy


# --- slow start ---------------------------------------------------------------------------------


def test_no_slow_start_when_the_gateway_starts() -> None:
    ns = mk(HealthConfig(), slow_start_sec=40)
    assert ns.effective(5, 0) == 5


def test_slow_start_after_health_recovery_is_linear() -> None:
    ns = mk(HealthConfig(fall=1, rise=1), slow_start_sec=40)
    ns.record_check(False, 100, None, "x")
    assert ns.record_check(True, 200, 1.0, None) == ["node_up"]
    got = [ns.effective(5, 200 + t) for t in (0, 5, 10, 15, 20, 30, 39.9)]
    assert got == [1, 1, 2, 2, 3, 4, 4]
    assert ns.effective(5, 240) == 5
    assert ns.effective(5, 1000) == 5
    # monotone non-decreasing from 1 to N
    assert got == sorted(got)


def test_slow_start_after_breaker_closes() -> None:
    ns = mk(open_sec=10, slow_start_sec=20)
    trip(ns, 0)
    ns.on_dispatch(10)
    ns.record_success(10, trial=True)
    assert ns.effective(3, 10) == 1
    assert ns.effective(3, 20) == 2
    assert ns.effective(3, 30) == 3
    # a single-slot route is never below 1
    ns2 = mk(open_sec=10, slow_start_sec=20)
    trip(ns2, 0)
    ns2.on_dispatch(10)
    ns2.record_success(10, trial=True)
    assert ns2.effective(1, 10) == 1


def test_slow_start_disabled() -> None:
    ns = mk(HealthConfig(fall=1, rise=1), slow_start_sec=0)
    ns.record_check(False, 1, None, "x")
    ns.record_check(True, 2, 1.0, None)
    assert ns.effective(4, 2) == 4


# --- drain --------------------------------------------------------------------------------------


def test_drained_node_takes_no_work() -> None:
    ns = mk()
    ns.drained = True
    assert not ns.available(0)
    assert ns.snapshot(0)["drained"] is True
    ns.drained = False
    assert ns.available(0)


@pytest.mark.parametrize("state", ["retired", "drained"])
def test_unavailable_states_keep_breaker_closed(state: str) -> None:
    ns = mk()
    setattr(ns, state, True)
    assert not ns.available(0)
    assert ns.breaker_state(0) == CLOSED
