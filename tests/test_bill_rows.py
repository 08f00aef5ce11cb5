"""The bill's rows (kilolined/scheduling/bill.py), pure: bounded, counters only, grouped and read back."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kilolined.scheduling.bill import (
    OTHER_MODEL,
    BadQuery,
    Bill,
    gpu_cost,
    group,
    parse_query,
    to_csv,
    total,
)

DAY = 86400.0
T0 = 20_000 * DAY  # 2024-10-04, midnight UTC


def test_rows_per_key_route_model_and_day() -> None:
    b = Bill(None)
    b.add(T0 + 10, "alice", "chat", "m1", requests=1, prompt_tokens=4, completion_tokens=5, gpu_seconds=2.0,
          cost_usd=gpu_cost(2.0, 3.6))
    b.add(T0 + 20, "alice", "chat", "m1", requests=1, prompt_tokens=1, completion_tokens=1, gpu_seconds=1.0)
    b.add(T0 + DAY + 5, "alice", "chat", None, requests=1)
    b.add(T0 + 30, None, "comfy", None, requests=1, gpu_seconds=math.nan, prompt_tokens=-3)  # odd amounts add nothing
    rows = dict(b.select(None, None))
    assert rows == {("2024-10-04", "alice", "chat", "m1"): [2, 5, 6, 3.0, 0.002],
                    ("2024-10-05", "alice", "chat", "-"): [1, 0, 0, 0, 0],
                    ("2024-10-04", "-", "comfy", "-"): [1, 0, 0, 0, 0]}
    assert [k for k, _ in b.select("2024-10-05", None)] == [("2024-10-05", "alice", "chat", "-")]
    assert [k for k, _ in b.select(None, None, key="-")] == [("2024-10-04", "-", "comfy", "-")]
    lines = group(b.select(None, None), ("key",))
    assert lines == [{"key": "-", "requests": 1, "prompt_tokens": 0, "completion_tokens": 0, "gpu_seconds": 0,
                      "cost_usd": 0},
                     {"key": "alice", "requests": 3, "prompt_tokens": 5, "completion_tokens": 6, "gpu_seconds": 3.0,
                      "cost_usd": 0.002}]
    assert total(b.select(None, None))["requests"] == 4
    parsed = list(csv.DictReader(io.StringIO(to_csv(lines, ("key",)))))
    assert [(r["key"], int(r["requests"]), float(r["cost_usd"])) for r in parsed] == [("-", 1, 0), ("alice", 3, 0.002)]


def test_the_oldest_days_go_first_when_the_bill_is_full() -> None:
    b = Bill(None, max_rows=6)
    for day in range(4):
        for key in ("a", "b"):
            b.add(T0 + day * DAY, key, "r", "m", requests=1)
        assert len(b.rows) <= 6
    assert sorted({k[0] for k in b.rows}) == ["2024-10-05", "2024-10-06", "2024-10-07"]
    # one day filling the bill alone: the rest of it is counted on one (other) row of the day
    for i in range(10):
        b.add(T0 + 9 * DAY, f"k{i}", "r", "m", requests=1)
    assert len(b.rows) <= 7
    assert b.rows[("2024-10-13", OTHER_MODEL, OTHER_MODEL, OTHER_MODEL)][0] == 10 - 6
    assert total(b.select(None, None))["requests"] == 10


def test_a_client_naming_new_models_cannot_grow_the_bill() -> None:
    b = Bill(None, max_models=3)
    for i in range(50):
        b.add(T0, "alice", "chat", f"model-{i}" + "x" * 1000, requests=1)
    models = [k[3] for k in b.rows]
    assert len(models) == 4 and models[-1] == OTHER_MODEL and all(len(m) <= 200 for m in models)
    assert b.rows[(b._today(T0), "alice", "chat", OTHER_MODEL)][0] == 47


def test_saved_and_read_back_counters_only(tmp_path: Path) -> None:
    b = Bill(str(tmp_path / "state"))
    b.add(T0, "alice", "chat", "m", requests=2, prompt_tokens=3, completion_tokens=4, gpu_seconds=1.5, cost_usd=0.1)
    b.save()
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["usage.json"]  # no temp file left
    data = json.loads((tmp_path / "state" / "usage.json").read_text())
    assert data == {"fields": ["day", "key", "route", "model", "requests", "prompt_tokens", "completion_tokens",
                               "gpu_seconds", "cost_usd"],
                    "rows": [["2024-10-04", "alice", "chat", "m", 2, 3, 4, 1.5, 0.1]]}
    assert Bill(str(tmp_path / "state")).rows == b.rows


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"rows": [[1]]}', b'{"rows": 5}', b"", b"\xff"])
def test_a_corrupt_file_costs_the_history_not_the_gateway(tmp_path: Path, garbage: bytes) -> None:
    (tmp_path / "usage.json").write_bytes(garbage)
    b = Bill(str(tmp_path))
    b.add(T0, "alice", "chat", "m", requests=1)
    b.save()
    assert list(Bill(str(tmp_path)).rows.values()) == [[1, 0, 0, 0, 0]]


def test_query_parameters() -> None:
    q = parse_query({})
    assert (q.first, q.last, q.group_by) == (None, None, ("day", "key", "route", "model"))
    q = parse_query({"from": "2026-12-01", "to": "2026-12-01", "group_by": "model,key"})
    assert (q.first, q.last, q.group_by) == ("2026-12-01", "2026-12-01", ("key", "model"))
    for bad in ({"from": "2026-02-30"}, {"to": "20261201"}, {"from": "2026-12-02", "to": "2026-12-01"},
                {"group_by": "key,node"}, {"group_by": ""}, {"from": "２０２６-12-01"}):
        with pytest.raises(BadQuery):
            parse_query(bad)


def test_cost_needs_a_price() -> None:
    assert gpu_cost(3600, 0.45) == pytest.approx(0.45)
    assert gpu_cost(3600, None) == 0 and gpu_cost(10, -1) == 0 and gpu_cost(10, math.inf) == 0


@settings(max_examples=150, deadline=None)
@example(adds=[(0, "a", "x", "m1"), (0, "a", "x", "m2"), (0, "a", "y", "m1")], max_rows=1, max_models=1)
@given(adds=st.lists(st.tuples(st.integers(0, 5), st.sampled_from("abcd"), st.sampled_from("xy"),
                               st.sampled_from(["m1", "m2", "m3", None])), min_size=1, max_size=80),
       max_rows=st.integers(1, 12), max_models=st.integers(1, 3))
def test_the_bill_stays_bounded_and_today_loses_nothing(adds: list[tuple[int, str, str, str | None]],
                                                        max_rows: int, max_models: int) -> None:
    """Whatever arrives (days moving forward), the rows stay within the cap (plus one overflow row),
    and every request of the newest day is still counted."""
    b = Bill(None, max_rows=max_rows, max_models=max_models)
    day = 0
    for step, key, route, model in adds:
        day += step
        b.add(T0 + day * DAY, key, route, model, requests=1)
        assert len(b.rows) <= max_rows + 1
    today = b._today(T0 + day * DAY)
    newest = sum(1 for i in range(len(adds)) if sum(a[0] for a in adds[:i + 1]) == day)
    assert sum(v[0] for k, v in b.rows.items() if k[0] == today) == newest
