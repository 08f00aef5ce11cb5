#!/usr/bin/env python3
"""The /admin/state snapshot for many routes: how long one takes to build and serialize.

The snapshot is built on the event loop, so its time is how long every other request (`/healthz`
included) waits while an operator's dashboard asks for it (every 0.5 s while open). Per size: a
config of N routes, each over its own node, with prompt tokens reported on each route (what the
dashboard's cached share reads); then the median of `--rounds` snapshots (`views.state` +
`orjson.dumps`, what `GET /admin/state` does). In-process, no sockets.

    python scripts/bench_state.py [--routes 1000,3000,10000] [--rounds 3] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import orjson
import yaml

from kilolined.core.config import parse_config
from kilolined.ops import views
from kilolined.ops.runtime import Runtime


def runtime(n: int) -> Runtime:
    cfg = {"server": {"listen": "127.0.0.1:0"},
           "nodes": {f"n{i}": {"url": f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}:8000"}
                     for i in range(n)},
           "routes": {f"r{i}": {"path": f"/r{i}", "nodes": [f"n{i}"]} for i in range(n)}}
    rt = Runtime(parse_config(yaml.safe_dump(cfg), env={}), "bench")
    for i in range(n):
        rt.metrics.prompt_tokens.labels(f"r{i}", f"n{i}", "true").inc(3)
        rt.metrics.prompt_tokens.labels(f"r{i}", f"n{i}", "false").inc(1)
    return rt


def measure(n: int, rounds: int) -> dict[str, Any]:
    rt = runtime(n)
    times = []
    size = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        size = len(orjson.dumps(views.state(rt)))
        times.append(time.perf_counter() - t0)
    return {"routes": n, "snapshot_ms": round(statistics.median(times) * 1000, 1), "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default="1000,3000,10000", help="route counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 1000 and 3000 routes, 1 round")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.routes, args.rounds = "1000,3000", 1
    results = []
    for n in (int(x) for x in args.routes.split(",")):
        r = measure(n, args.rounds)
        results.append(r)
        print(f"{r['routes']:>7} routes  {r['snapshot_ms']:>9.1f} ms a snapshot  {r['bytes'] / 1e6:6.1f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
