"""/admin/state is built on the event loop (and a dashboard asks for it every 0.5 s): its work must
grow with the routes and nodes, not with their product. Counted, not timed: the Python lines the
snapshot runs for 40 and for 160 routes (each with its own node, each with prompt tokens
reported), which a quadratic part multiplies by 16 where a linear one multiplies by 4."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import yaml

from kilolined.core.config import parse_config
from kilolined.ops import views
from kilolined.ops.runtime import Runtime


def runtime(n: int) -> Runtime:
    cfg = {"server": {"listen": "127.0.0.1:0"},
           "nodes": {f"n{i}": {"url": f"http://10.0.{i // 250}.{i % 250 + 1}:8000"} for i in range(n)},
           "routes": {f"r{i}": {"path": f"/r{i}", "nodes": [f"n{i}"], "max_concurrency": 2} for i in range(n)}}
    rt = Runtime(parse_config(yaml.safe_dump(cfg), env={}), "v")
    for i in range(n):
        rt.metrics.prompt_tokens.labels(f"r{i}", f"n{i}", "true").inc(3)
        rt.metrics.prompt_tokens.labels(f"r{i}", f"n{i}", "false").inc(1)
    return rt


def lines_run(rt: Runtime) -> tuple[int, dict[str, Any]]:
    """The Python lines ``views.state`` runs (loop iterations count: a loop's jump back is a line)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        snap = views.state(rt)
    finally:
        sys.settrace(None)
    return count, snap


def test_the_snapshot_grows_linearly_with_the_routes() -> None:
    small, snap = lines_run(runtime(40))
    assert snap["nodes"]["n7"]["slots"] == 2 and snap["routes"]["r7"]["prompt_tokens"] == {"cached": 3, "total": 4}
    large, snap = lines_run(runtime(160))
    assert snap["nodes"]["n150"]["slots"] == 2
    assert snap["routes"]["r150"]["prompt_tokens"] == {"cached": 3, "total": 4}
    assert large < 6 * small, (small, large)  # 4x the routes: about 4x the work, never 16x


def test_a_node_shared_by_routes_sums_their_slots_once_each() -> None:
    cfg = {"server": {"listen": "127.0.0.1:0"},
           "nodes": {"a": {"url": "http://10.0.0.1:8000"}, "b": {"url": "http://10.0.0.2:8000"}},
           "routes": {"x": {"path": "/x", "nodes": ["a"], "standby": ["b"], "max_concurrency": 2},
                      "y": {"path": "/y", "nodes": ["a", "b"], "max_concurrency": 3}}}
    snap = views.state(Runtime(parse_config(yaml.safe_dump(cfg), env={}), "v"))
    assert (snap["nodes"]["a"]["slots"], snap["nodes"]["b"]["slots"]) == (5, 5)
    assert snap["routes"]["x"]["prompt_tokens"] == {"cached": 0, "total": 0}
