"""kilolined.scheduling.speed: size-normalised speed, peers, drift — pure logic on an injected clock (SPEC §14)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.core.config import SlowConfig
from kilolined.scheduling.speed import (
    MS_PROMPT_TOKEN,
    MS_TOKEN,
    OK,
    SLOW,
    Sample,
    SpeedBook,
    Verdict,
    ejectable,
    llm_samples,
)

SEEDS = settings(max_examples=5, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


class Fleet:
    """Nodes of one route fed one sample at a time, with the watch's rules for who may go."""

    def __init__(self, names: list[str], cfg: SlowConfig | None = None):
        self.names, self.cfg, self.book = names, cfg or SlowConfig(), SpeedBook()
        self.verdicts: list[Verdict] = []

    def feed(self, node: str, value: float, now: float) -> Verdict | None:
        out = sum(1 for n in self.names if self.book.node(n).ejected)
        others = sum(1 for n in self.names if n != node and not self.book.node(n).ejected)
        v = self.book.record(node, "chat", "m", Sample(MS_TOKEN, value), now, self.cfg,
                             lambda: ejectable(len(self.names), out, others))
        if v is not None:
            self.verdicts.append(v)
        return v


def noisy(rnd: random.Random, ms: float, sigma: float) -> float:
    return ms * rnd.lognormvariate(0, sigma)


def test_an_hour_of_lognormal_noise_rarely_ejects_and_never_for_good() -> None:
    # Three equal nodes, σ 0.5 (GPU timings are that noisy), one answer every 4 s on each. Such
    # noise now and then makes a run that the rule cannot tell from a slowdown: 3 of 2,000 hours
    # (seeds 18000-19999; 18569, 18819, 19349) soft-eject one node for a period, which then comes
    # back ("recovered"); none in seeds 0-299. So the claim is a rate over fixed seeds, not
    # "never" for whatever seed a property test draws.
    ejected = []
    for seed in range(100):
        rnd, fleet = random.Random(seed), Fleet(["a", "b", "c"])
        t = 0.0
        while t < 3600:
            for n in fleet.names:
                fleet.feed(n, noisy(rnd, 20, 0.5), t)
            t += 4
        if fleet.verdicts:
            ejected.append(seed)
        assert all(v.action in ("soft", "recovered") for v in fleet.verdicts), (seed, fleet.verdicts)
    assert len(ejected) <= 2, ejected


def test_a_soft_eject_by_noise_comes_back_within_the_hour() -> None:
    # seed 18819: the hour whose noise soft-ejected node b (2.1x its peers' level for a while)
    rnd, fleet = random.Random(18819), Fleet(["a", "b", "c"])
    t = 0.0
    while t < 3600:
        for n in fleet.names:
            if fleet.feed(n, noisy(rnd, 20, 0.5), t) is not None and fleet.book.node(n).ejected:
                fleet.book.eject_period(n, t, 3, 300)
        t += 4
    assert [v.action for v in fleet.verdicts] == ["soft", "recovered"]
    assert all(fleet.book.node(n).state == OK for n in fleet.names)


@SEEDS
@given(seed=st.integers(0, 2**32 - 1))
def test_a_node_three_times_slower_is_flagged_within_ten_of_its_requests(seed: int) -> None:
    rnd, fleet = random.Random(seed), Fleet(["a", "b", "c"])
    t = 0.0
    for _ in range(60):  # warm: every node has served a while
        for n in fleet.names:
            fleet.feed(n, noisy(rnd, 20, 0.2), t)
        t += 1
    assert fleet.verdicts == []
    flagged_at = None
    for i in range(1, 11):
        for n in fleet.names:
            v = fleet.feed(n, noisy(rnd, 60 if n == "c" else 20, 0.2), t)
            if v is not None and flagged_at is None:
                assert v.node == "c" and v.action in ("soft", "hard")
                flagged_at = i
        t += 1
    assert flagged_at is not None and flagged_at <= 10
    assert fleet.book.node("c").state == SLOW
    v = fleet.verdicts[0]
    assert v.unit == MS_TOKEN and v.level > 1.5 * v.peers  # type: ignore[operator]


@SEEDS
@given(seed=st.integers(0, 2**32 - 1))
def test_two_nodes_never_eject_the_second(seed: int) -> None:
    rnd, fleet = random.Random(seed), Fleet(["a", "b"])
    t = 0.0
    for k in range(400):
        fleet.feed("a", noisy(rnd, 20, 0.3), t)
        fleet.feed("b", noisy(rnd, 80 if k >= 50 else 20, 0.3), t)  # b turns 4× slower
        t += 2
    ejected = [v.node for v in fleet.verdicts if v.action in ("soft", "hard")]
    assert ejected and set(ejected) == {"b"}  # b (soft, then hard at 3×), never a
    assert fleet.book.node("a").state == OK


def test_a_node_alone_degrading_18_percent_in_36_hours_drifts_once() -> None:
    # drift 1.15: the default 1.3 is above an 18 % fall; once an hour is judged against its best
    rnd = random.Random(7)
    fleet = Fleet(["solo"], SlowConfig(drift=1.15))
    t = 0.0
    while t < 40 * 3600:
        slowdown = 1 + 0.18 * min(t, 36 * 3600) / (36 * 3600)
        fleet.feed("solo", noisy(rnd, 20 * slowdown, 0.1), t)
        t += 20
    drifts = [v for v in fleet.verdicts if v.action == "drifting"]
    assert len(drifts) == 1 and fleet.verdicts == drifts
    assert drifts[0].level > 1.15 * drifts[0].peers  # type: ignore[operator]
    assert fleet.book.node("solo").state == OK and fleet.book.node("solo").drifting
    assert fleet.book.view("solo")["state"] == "drifting"  # type: ignore[index]


def test_a_lone_node_under_noise_never_drifts_nor_ejects() -> None:
    rnd, fleet = random.Random(3), Fleet(["solo"])
    t = 0.0
    while t < 12 * 3600:
        fleet.feed("solo", noisy(rnd, 20, 0.5), t)
        t += 10
    assert fleet.verdicts == []


def test_far_slower_is_a_hard_eject_and_a_recovered_node_is_told() -> None:
    rnd, fleet = random.Random(1), Fleet(["a", "b", "c"])
    t = 0.0
    for _ in range(40):
        for n in fleet.names:
            fleet.feed(n, noisy(rnd, 20, 0.1), t)
        t += 1
    for _ in range(15):
        for n in fleet.names:
            fleet.feed(n, noisy(rnd, 200 if n == "c" else 20, 0.1), t)
        t += 1
    assert [v.action for v in fleet.verdicts] == ["hard"]
    period = fleet.book.eject_period("c", t, 10, 300)
    assert period == 10 and not fleet.book.trial("c", t + 9)
    assert fleet.book.trial("c", t + 10) and not fleet.book.node("c").ejected
    t += 10
    for _ in range(30):  # its trial: back to speed
        for n in fleet.names:
            fleet.feed(n, noisy(rnd, 20, 0.1), t)
        t += 1
    assert [v.action for v in fleet.verdicts] == ["hard", "recovered"]
    assert fleet.book.node("c").state == OK
    # a clean recovery: the next eject starts from open_sec again
    assert fleet.book.eject_period("c", t, 10, 300) == 10


def test_a_failed_trial_is_ejected_again_for_twice_as_long() -> None:
    rnd, fleet = random.Random(2), Fleet(["a", "b", "c"])
    t = 0.0
    for k in range(200):
        for n in fleet.names:
            fleet.feed(n, noisy(rnd, 50 if n == "c" and k >= 40 else 20, 0.1), t)
        t += 1
        if fleet.verdicts and fleet.book.node("c").until == 0 and fleet.book.node("c").ejected:
            fleet.book.eject_period("c", t, 10, 300)
        fleet.book.trial("c", t)
    soft = [v for v in fleet.verdicts if v.action == "soft"]
    assert len(soft) >= 2 and all(v.node == "c" for v in soft)
    assert fleet.book.node("c").period >= 20


def test_min_gap_keeps_tiny_differences_quiet() -> None:
    fleet = Fleet(["a", "b", "c"], SlowConfig(min_gap_ms=50))
    for k in range(200):
        for n in fleet.names:
            fleet.feed(n, 40.0 if n == "c" and k > 30 else 10.0, float(k))
    assert fleet.verdicts == []  # 4× slower, but only 30 ms per token


def test_llm_speed_from_llama_timings_else_from_usage_and_the_gateways_clock() -> None:
    timings = {"prompt_n": 200, "prompt_per_token_ms": 0.5, "predicted_n": 50, "predicted_per_token_ms": 21.0}
    assert llm_samples(9.0, None, None, timings) == [Sample(MS_TOKEN, 21.0), Sample(MS_PROMPT_TOKEN, 0.5)]
    usage = {"prompt_tokens": 120, "completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 20}}
    got = llm_samples(1.2, 0.2, usage, None)
    assert got[0].unit == MS_TOKEN and abs(got[0].value - 100.0) < 1e-9  # (1.2 - 0.2) s / 10 tokens
    assert got[1].unit == MS_PROMPT_TOKEN and abs(got[1].value - 2.0) < 1e-9  # 0.2 s / 100 uncached
    assert llm_samples(1.0, None, {"completion_tokens": 4}, None) == [Sample(MS_TOKEN, 250.0)]
    assert llm_samples(1.0, None, {"completion_tokens": "x"}, {"predicted_n": -1}) == []


def test_no_more_than_a_tenth_of_a_route_and_never_the_last() -> None:
    assert ejectable(2, 0, 1) == 1 and ejectable(2, 1, 0) == 0
    assert ejectable(3, 1, 1) == 0
    assert ejectable(20, 1, 18) == 1 and ejectable(20, 2, 17) == 0
    assert ejectable(5, 0, 0) == 0


def test_a_forgotten_node_is_no_ones_peer() -> None:
    fleet = Fleet(["a", "b", "c"])
    for k in range(30):
        for n in fleet.names:
            fleet.feed(n, 20.0, float(k))
    fleet.book.forget("c")
    assert all(k[0] != "c" for k in fleet.book.series)
    assert set(fleet.book.groups[("chat", "m", MS_TOKEN)]) == {"a", "b"}
    assert fleet.book.view("c") is None and fleet.book.view("a")["peers_median"] == 20.0  # type: ignore[index]


def lone_node(seed: int, per_hour: float, sigma: float, slow_after: int, factor: float,
              requests: int, cfg: SlowConfig | None = None) -> tuple[Fleet, list[int]]:
    """One node alone on its route, ``per_hour`` requests an hour, ``factor`` × slower from its
    ``slow_after``-th request; returns the fleet and the request numbers of its verdicts."""
    rnd, fleet = random.Random(seed), Fleet(["solo"], cfg)
    at: list[int] = []
    for i in range(requests):
        ms = 20 * (factor if i >= slow_after else 1)
        if fleet.feed("solo", noisy(rnd, ms, sigma), i * 3600 / per_hour) is not None:
            at.append(i)
    return fleet, at


@SEEDS
@given(seed=st.integers(0, 2**32 - 1), per_hour=st.sampled_from([4.0, 60.0, 3600.0]))
def test_a_lone_node_turning_twice_as_slow_drifts_within_40_of_its_requests(seed: int, per_hour: float) -> None:
    # It has served `samples` (20) requests; whatever its traffic per hour, even 4 requests an hour,
    # it is judged at every request, against the level it had until then.
    fleet, at = lone_node(seed, per_hour, 0.2, 20, 2.0, 60)
    assert at and at[0] - 20 < 40
    assert [v.action for v in fleet.verdicts] == ["drifting"]  # alerted once, never ejected
    v = fleet.verdicts[0]
    assert v.peers is not None and v.level > 1.3 * v.peers
    assert fleet.book.node("solo").state == OK and fleet.book.view("solo")["state"] == "drifting"  # type: ignore[index]


@pytest.mark.parametrize(("per_hour", "runs", "requests"), [(20.0, 300, 1440), (3600.0, 30, 3600)])
def test_a_lone_node_under_lognormal_noise_rarely_raises_a_drift(per_hour: float, runs: int, requests: int) -> None:
    # σ 0.5 for a whole hour at one request a second, or three days at 20 an hour. Such noise now
    # and then makes a run of slow requests that the rule cannot tell from a slowdown (2 of 300
    # three-day runs over seeds 0-299 raise one alert, an alert only: drift never ejects), so the
    # claim is a rate over fixed seeds, not "never" for whatever seed a property test draws.
    alarmed = [seed for seed in range(runs) if lone_node(seed, per_hour, 0.5, 10**9, 1.0, requests)[1]]
    assert len(alarmed) <= runs * 0.02, alarmed


def test_a_drifting_node_is_alerted_again_only_after_it_came_back() -> None:
    rnd, fleet = random.Random(5), Fleet(["solo"])
    t = 0.0
    for phase, (factor, n) in enumerate([(1, 40), (2, 80), (1, 150), (2, 80)]):
        for _ in range(n):
            fleet.feed("solo", noisy(rnd, 20 * factor, 0.1), t)
            t += 60
        assert fleet.book.node("solo").drifting == (factor == 2), phase
    assert [v.action for v in fleet.verdicts] == ["drifting", "drifting"]


def run_ejected(fleet: Fleet, rnd: random.Random, slow_ms: float, t: float, n: int) -> tuple[float, list[int]]:
    """``n`` rounds of one request on each node (c at ``slow_ms``), the watch's clock applied as
    speedwatch does (the period starts at the eject, the trial when it is over); returns the time
    and the rounds at which c was ejected."""
    ejected_at = []
    for k in range(n):
        for name in fleet.names:
            v = fleet.feed(name, noisy(rnd, slow_ms if name == "c" else 20, 0.1), t)
            if v is not None and v.action in ("soft", "hard"):
                fleet.book.eject_period("c", t, 3, 300)
                ejected_at.append(k)
        fleet.book.trial("c", t)
        t += 0.25
    return t, ejected_at


def test_a_trial_keeps_the_ewma_so_a_node_still_slow_is_out_again_after_evaluations_requests() -> None:
    rnd, fleet = random.Random(4), Fleet(["a", "b", "c"])
    t, _ = run_ejected(fleet, rnd, 20, 0.0, 40)
    t, ejected = run_ejected(fleet, rnd, 40, t, 13)  # 2× slower: a soft eject, 3 s at 4 rounds a second
    assert len(ejected) == 1 and fleet.book.node("c").ejected
    first = fleet.book.node("c")
    assert first.period == 3
    # its trial comes at the end of the period; still slow, it is out again after `evaluations`
    # of its requests (not after a fresh `samples`), for twice as long
    while not fleet.book.trial("c", t):
        t, got = run_ejected(fleet, rnd, 40, t, 1)
        assert got == []
    t, again = run_ejected(fleet, rnd, 40, t, fleet.cfg.evaluations)
    assert again == [fleet.cfg.evaluations - 1]
    assert fleet.book.node("c").period == 6 and fleet.book.node("c").ejections == 2


def test_a_trial_that_shows_the_node_back_to_speed_recovers_it_without_a_second_eject() -> None:
    rnd, fleet = random.Random(6), Fleet(["a", "b", "c"])
    t, _ = run_ejected(fleet, rnd, 20, 0.0, 40)
    t, ejected = run_ejected(fleet, rnd, 40, t, 12)
    assert len(ejected) == 1
    t += 3  # the period: no request reaches it meanwhile, as if hard-ejected
    t, again = run_ejected(fleet, rnd, 20, t, 60)  # its trial: back to speed
    assert again == []
    assert [v.action for v in fleet.verdicts] == ["soft", "recovered"]
    assert fleet.book.node("c").state == OK
