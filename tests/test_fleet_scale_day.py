"""SPEC §18's "what it must deliver", on a simulated clock: a day-shaped trace (a quiet night,
a morning ramp, bursts) through a pool ``min: 0, max: 3`` against a fixed pool of 3, with the
fleet's own policy deciding (kilolined/fleet/simulate.py; the same run as
scripts/bench_fleet_scale.py, on a coarser tick). Behaviour on simulated time, not wall-clock
timing.
"""

from __future__ import annotations

import pytest

from kilolined.fleet.decide import PoolSpec
from kilolined.fleet.simulate import Market, day_trace, simulate

MARKET = Market(price=0.40, boot_sec=300.0, resume_sec=30.0)
SCALE_UP_WAIT = 20.0
SCALING = PoolSpec(0, 3, 900.0, (0.40,), SCALE_UP_WAIT, 600.0, 86400.0)
TICK = 5.0  # coarser than the benchmark's 1 s: a day in well under a second


@pytest.fixture(scope="module")
def trace() -> list:
    return day_trace(seed=1)


@pytest.mark.parametrize("stopped", [3, 0], ids=["as-a-previous-day-left-it", "cold"])
def test_a_day_costs_at_most_half_a_fixed_pool_and_keeps_p95_within_the_resume(trace: list, stopped: int) -> None:
    fixed = simulate(trace, PoolSpec.fixed(3, 900.0, 0.40), MARKET, cap=1.2, tick_sec=TICK, warm=3)
    scaled = simulate(trace, SCALING, MARKET, cap=1.2, tick_sec=TICK, stopped=stopped)
    assert fixed.gpu_hours == pytest.approx(72.0, abs=0.01) and fixed.lost == 0
    assert scaled.gpu_hours <= 0.5 * fixed.gpu_hours
    assert scaled.lost == 0 and len(scaled.waits) == len(trace)
    assert scaled.p(0.95) <= SCALE_UP_WAIT + MARKET.resume_sec
    assert scaled.max_spend <= 1.2 + 1e-9 and scaled.max_instances <= 3
    # The night is quiet: instances were stopped and, when the queue came back, resumed rather
    # than rented (what a cold start rents, it rents once).
    assert scaled.stops > 0 and scaled.resumes > 0 and scaled.rents <= 3 - stopped


def test_the_spend_cap_holds_the_pool_below_max_and_nothing_is_lost(trace: list) -> None:
    capped = simulate(trace, SCALING, MARKET, cap=0.8, tick_sec=TICK, stopped=3)
    assert capped.max_spend <= 0.8 + 1e-9 and capped.max_instances == 2
    assert capped.lost == 0
