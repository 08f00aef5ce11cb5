"""Budgets.add: usage only ever spends (zero, negative and non-finite amounts add nothing)."""

from __future__ import annotations

import math

import pytest

from kilolined.scheduling.limits import Budgets, spent_amount


@pytest.mark.parametrize("amount", [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan, 1, 2.5, 1e-9])
def test_budget_add_counts_only_finite_positive_amounts(amount: float) -> None:
    b = Budgets(None)
    wall = 86400.0 * 20000 + 5
    b.add("k", wall, requests=1, tokens=3, gpu_seconds=0.25)
    b.add("k", wall, requests=amount, tokens=amount, gpu_seconds=amount)  # type: ignore[arg-type]
    u = b.usage("k", wall)
    want = spent_amount(amount)
    assert u == {"requests": 1 + want, "tokens": 3 + want, "gpu_seconds": 0.25 + want}
    assert b.dirty


def test_budget_add_of_nothing_still_records_the_key() -> None:
    b = Budgets(None)
    b.add("k", 1000.0)
    assert b.used == {"k": {"requests": 0.0, "tokens": 0.0, "gpu_seconds": 0.0}}
