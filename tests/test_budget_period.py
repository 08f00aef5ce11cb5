"""Budgets per ``day`` or ``month`` (keys.<id>.budget.period): pure, on an injected wall clock."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolined.core.config import BudgetConfig, ConfigError, parse_config
from kilolined.scheduling.limits import Budgets, period_label, seconds_to_period_end

MONTHLY = BudgetConfig(requests_per_day=3, period="month")


def wall(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: float = 0) -> float:
    return dt.datetime(y, mo, d, h, mi, tzinfo=dt.UTC).timestamp() + s


def test_a_month_budget_is_not_reset_at_midnight_but_at_the_month() -> None:
    b = Budgets(None, periods={"alice": "month"})
    daily = BudgetConfig(requests_per_day=3)
    for w in (wall(2026, 1, 30, 23, 59), wall(2026, 1, 31, 0, 1), wall(2026, 1, 31, 23, 59, 59)):
        assert b.take_request("alice", MONTHLY, w) is None
        assert b.take_request("bob", daily, w) is None  # bob's counts per day
    # Midnight UTC of Jan 31 → Feb 1 is a day boundary and a month boundary; the day before was not.
    assert b.take_request("alice", MONTHLY, wall(2026, 1, 31, 23, 59, 59)) == "requests_per_day"
    assert b.usage("bob", wall(2026, 1, 31, 23, 59, 59))["requests"] == 2  # Jan 31: two of bob's
    assert b.take_request("alice", MONTHLY, wall(2026, 2, 1, 0, 0, 1)) is None
    assert b.usage("alice", wall(2026, 2, 1, 0, 0, 1))["requests"] == 1
    assert b.label("alice", wall(2026, 2, 9)) == "2026-02" and b.label("bob", wall(2026, 2, 9)) == "2026-02-09"


def test_month_counters_survive_a_restart_across_days(tmp_path: Path) -> None:
    b = Budgets(str(tmp_path), periods={"alice": "month"})
    b.add("alice", wall(2026, 3, 2, 10), requests=2, tokens=50)
    b.add("bob", wall(2026, 3, 2, 10), requests=1)
    b.save()
    b2 = Budgets(str(tmp_path), periods={"alice": "month"})
    later = wall(2026, 3, 20, 8)  # another day of the same month
    assert b2.usage("alice", later) == {"requests": 2, "tokens": 50, "gpu_seconds": 0}
    assert b2.usage("bob", later)["requests"] == 0  # a day budget: that day is over
    b2.save()
    b3 = Budgets(str(tmp_path), periods={"alice": "month"})
    assert b3.usage("alice", wall(2026, 4, 1, 0, 0, 1))["requests"] == 0


def test_retry_after_runs_to_the_end_of_the_window() -> None:
    w = wall(2026, 2, 27, 12)
    assert seconds_to_period_end("day", w) == 12 * 3600
    assert seconds_to_period_end("month", w) == (36 * 3600)  # Feb 28 2026 is the last day
    assert seconds_to_period_end("month", wall(2026, 12, 31, 23, 59, 59)) == 1
    assert period_label("month", w) == "2026-02" and period_label("day", w) == "2026-02-27"


@settings(max_examples=200, deadline=None)
@given(start=st.floats(min_value=wall(2020, 1, 1), max_value=wall(2040, 1, 1)),
       steps=st.lists(st.floats(min_value=0, max_value=40 * 86400), min_size=1, max_size=30),
       period=st.sampled_from(["day", "month"]))
def test_counters_hold_exactly_the_requests_of_the_current_window(start: float, steps: list[float],
                                                                   period: str) -> None:
    """Whatever the times (moving forward), the count is the number of requests taken in the
    window the last one falls in: never reset inside a window, always reset across one."""
    b = Budgets(None, periods={"k": period} if period == "month" else {})
    w = start
    taken: list[float] = []
    for step in steps:
        w += step
        b.take_request("k", BudgetConfig(period=period), w)  # type: ignore[arg-type]
        taken.append(w)
        window = period_label(period, w)
        assert b.usage("k", w)["requests"] == sum(1 for t in taken if period_label(period, t) == window)
        assert 1 <= seconds_to_period_end(period, w) <= 31 * 86400
        assert period_label(period, w + seconds_to_period_end(period, w)) != window


def test_period_is_checked_with_file_and_line() -> None:
    text = ("nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\nroutes:\n  gen: {path: /gen, nodes: [gpu]}\n"
            "keys:\n  alice:\n    key: kl_alice_key_0000000000000000000000\n"
            "    budget:\n      requests_per_day: 5\n      period: week\n")
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={}, source="cfg.yaml")
    assert len(ei.value.errors) == 1
    assert re.match(r"^cfg\.yaml:10: keys\.alice\.budget\.period: Input should be 'day' or 'month'", ei.value.errors[0])
    ok = parse_config(text.replace("week", "month"), env={})
    assert ok.keys["alice"].budget is not None and ok.keys["alice"].budget.period == "month"
    assert parse_config(text.replace("      period: week\n", ""), env={}).keys["alice"].budget.period == "day"  # type: ignore[union-attr]


def test_a_route_cannot_take_the_usage_path() -> None:
    text = "nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\nroutes:\n  gen: {path: /v1/usage, nodes: [gpu]}\n"
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={})
    assert any("routes.gen.path: '/v1/usage' is reserved by the gateway" in e for e in ei.value.errors)
