"""The dashboard's server-side history ring, on a hand-held clock."""

from __future__ import annotations

import pytest

from kilolined.ops.history import History


class Clock:
    def __init__(self, t: float = 5000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(clock: Clock, span: float = 10, step: float = 1) -> History:
    return History(("queue_depth", "inflight"), span_sec=span, step_sec=step, clock=clock)


def test_one_bucket_per_step_keeps_the_peak_of_each_series() -> None:
    clock = Clock()
    h = make(clock)
    h.record({"gen": (0, 1)})
    clock.t += 0.25
    h.record({"gen": (7, 0)})  # the burst peaks inside the step ...
    clock.t += 0.25
    h.record({"gen": (2, 2)})  # ... and is partly gone by its end: the peak is what stays
    clock.t += 0.6
    h.record({"gen": (1, 2)})
    snap = h.snapshot()
    assert snap["step_sec"] == 1 and snap["span_sec"] == 10
    assert snap["routes"] == {"gen": {"queue_depth": [7, 1], "inflight": [2, 2]}}


def test_only_the_span_is_kept() -> None:
    clock = Clock()
    h = make(clock, span=5)
    for q in range(12):
        h.record({"gen": (q, 0)})
        clock.t += 1
    clock.t -= 1
    assert h.snapshot()["routes"]["gen"]["queue_depth"] == [7, 8, 9, 10, 11]
    assert len(h._rings["gen"]) == 5


def test_a_gap_is_none_and_old_buckets_age_out_without_new_ones() -> None:
    clock = Clock()
    h = make(clock, span=5)
    h.record({"gen": (3, 1)})
    clock.t += 3
    h.record({"gen": (4, 1)})
    assert h.snapshot()["routes"]["gen"]["queue_depth"] == [3, None, None, 4]
    clock.t += 2  # the first bucket is now older than the span
    assert h.snapshot()["routes"]["gen"]["queue_depth"] == [4, None, None]  # from the oldest kept to now
    clock.t += 10
    assert h.snapshot()["routes"] == {}  # nothing left in the span
    h.record({"gen": (1, 1)})
    assert len(h._rings["gen"]) == 1  # the stale buckets left the ring, not just the snapshot


def test_a_route_gone_from_the_config_is_forgotten() -> None:
    clock = Clock()
    h = make(clock)
    h.record({"gen": (1, 1), "old": (5, 5)})
    clock.t += 1
    h.record({"gen": (2, 1)})
    assert set(h.snapshot()["routes"]) == {"gen"}


def test_fractional_steps_and_bad_input() -> None:
    clock = Clock(0.0)
    h = make(clock, span=2, step=0.5)
    for q in range(6):
        h.record({"gen": (q, 0)})
        clock.t += 0.5
    clock.t -= 0.5
    assert h.snapshot()["routes"]["gen"]["queue_depth"] == [2, 3, 4, 5]
    with pytest.raises(ValueError):
        h.record({"gen": (1,)})
    with pytest.raises(ValueError):
        History(("q",), span_sec=1, step_sec=0)
