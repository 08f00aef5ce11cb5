"""The operator's views over a Runtime driven by a hand-held clock: slow start made visible."""

from __future__ import annotations

from typing import Any

import yaml
from conftest import base_config

from kilolined import status
from kilolined.core.config import parse_config
from kilolined.ops import views
from kilolined.ops.runtime import Runtime


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def runtime(clock: Clock, tmp_path: Any, **node: Any) -> Runtime:
    cfg = base_config({"a": "http://127.0.0.1:9"}, max_concurrency=4)
    cfg["server"]["state_dir"] = str(tmp_path)
    cfg["nodes"]["a"].update({"health": {"path": "/health", "fall": 1, "rise": 1},
                              "breaker": {"slow_start_sec": 12}, **node})
    return Runtime(parse_config(yaml.safe_dump(cfg), env={}), "v1", clock=clock)


def recover(rt: Runtime, clock: Clock) -> None:
    ns = rt.scheduler.nodes["a"]
    assert ns.record_check(False, clock(), None, "refused") == ["node_down"]
    clock.t += 5
    assert ns.record_check(True, clock(), 3.0, None) == ["node_up"]


def test_a_node_at_full_strength_is_not_ramping(tmp_path) -> None:
    clock = Clock()
    node = views.state(runtime(clock, tmp_path))["nodes"]["a"]
    assert (node["slots"], node["full_slots"], node["ramping"], node["full_in_sec"]) == (4, 4, False, None)
    assert status.ramp_text(node) == "-"


def test_slow_start_shows_its_slots_and_its_end(tmp_path) -> None:
    clock = Clock()
    rt = runtime(clock, tmp_path)
    recover(rt, clock)
    node = views.state(rt)["nodes"]["a"]
    assert (node["slots"], node["full_slots"], node["ramping"], node["full_in_sec"]) == (1, 4, True, 12.0)
    assert views.state(rt)["routes"]["gen"]["slots"] == 1
    clock.t += 4.5  # 1 + floor(4.5/12 × 3) = 2 slots, 7.5 s to go
    node = views.state(rt)["nodes"]["a"]
    assert (node["slots"], node["full_in_sec"]) == (2, 7.5)
    assert status.ramp_text(node) == "ramping 2→4, full in 8s"
    assert "ramping 2→4, full in 8s" in status.render(views.state(rt))
    clock.t += 7.5
    node = views.state(rt)["nodes"]["a"]
    assert (node["slots"], node["full_slots"], node["ramping"], node["full_in_sec"]) == (4, 4, False, None)


def test_a_node_cap_bounds_the_full_slots(tmp_path) -> None:
    clock = Clock()
    rt = runtime(clock, tmp_path, max_concurrency=3)
    recover(rt, clock)
    node = views.state(rt)["nodes"]["a"]
    assert (node["slots"], node["full_slots"], node["ramping"]) == (1, 3, True)
    clock.t += 6  # route: 1 + floor(.5 × 3) = 2; cap: 1 + floor(.5 × 2) = 2
    assert views.state(rt)["nodes"]["a"]["slots"] == 2


def test_a_down_node_is_not_ramping(tmp_path) -> None:
    clock = Clock()
    rt = runtime(clock, tmp_path)
    recover(rt, clock)
    rt.scheduler.nodes["a"].record_check(False, clock(), None, "refused")
    node = views.state(rt)["nodes"]["a"]
    assert node["health"] == "down" and not node["ramping"] and node["full_in_sec"] is None


def test_a_card_shows_in_the_state_and_in_status(tmp_path) -> None:
    """Two nodes on one card (docs/CONFIG.md#cards): the card's slots cap the node's, and status
    prints the card with what it holds."""
    cfg = base_config({"a": "http://127.0.0.1:9"}, max_concurrency=4, cost={"base": 2.5})
    cfg["server"]["state_dir"] = str(tmp_path)
    cfg["routes"]["gen2"] = {**cfg["routes"]["gen"], "path": "/gen2", "nodes": ["b"]}
    cfg["nodes"] = {"a": {"url": "http://127.0.0.1:9", "card": "gpu"},
                    "b": {"url": "http://127.0.0.1:10", "card": "gpu"}}
    cfg["cards"] = {"gpu": {"max_concurrency": 3, "capacity": 8}}
    clock = Clock()
    rt = Runtime(parse_config(yaml.safe_dump(cfg), env={}), "v1", clock=clock)
    rt.scheduler.admit("gen", "alice", 0, clock(), cost=2.5)
    st = views.state(rt)
    assert st["cards"] == {"gpu": {"max_concurrency": 3, "capacity": 8, "inflight": 1, "capacity_used": 2.5,
                                   "nodes": ["a", "b"]}}
    assert (st["nodes"]["a"]["slots"], st["nodes"]["a"]["card"]) == (3, "gpu")
    lines = status.render(st).splitlines()
    assert lines[-3].split() == ["CARD", "NODES", "INFLIGHT", "CAPACITY"]
    assert lines[-1].split() == ["gpu", "a,b", "1/3", "2.5/8"]
