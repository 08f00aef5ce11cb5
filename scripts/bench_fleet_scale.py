#!/usr/bin/env python3
"""A pool that follows the queue against a fixed pool, over a day of traffic (SPEC §18; docs/FLEET.md
"What scaling costs"), on a simulated clock.

The fleet's own policy (kilolined/fleet/decide.py) runs once a simulated tick against a simulated
queue and market (kilolined/fleet/simulate.py): a fresh instance serves `--boot-sec` after its
rent, a stopped one `--resume-sec` after its resume. The trace is a day: a quiet night, a morning
ramp, bursts at 10:00 and 20:00, seeded Poisson arrivals of `--service-sec` ± 25 % jobs, one
at a time per instance. Legs, on the same trace:

- **fixed 3**: `size: 3`, three instances serving all day;
- **min 0, max 3**: starting as a previous day leaves it (3 stopped instances);
- **min 0, max 3, cold**: starting with nothing (the first request waits for a fresh boot).

Reported per leg: GPU-hours paid (and $ at `--price`), against the fixed pool; the wait before
a request starts, p50 / p95 / max; requests lost (waited past `queue_timeout_sec`); rents,
resumes, stops; the peak spend against `max_spend_per_hour`. Targets (SPEC §18): GPU-hours
≤ 0.5× the fixed pool, p95 wait ≤ scale_up_wait_sec + the resume time, 0 lost, the cap never
passed. Prints "targets met" or exits 1. A day takes a few seconds; nothing waits on a wall clock.

    .venv/bin/python scripts/bench_fleet_scale.py [--seed 1] [--boot-sec 300] [--resume-sec 30]
        [--scale-up-wait-sec 20] [--idle-stop-sec 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kilolined.fleet.decide import PoolSpec
from kilolined.fleet.simulate import Market, Result, day_trace, simulate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--service-sec", type=float, default=20.0)
    ap.add_argument("--boot-sec", type=float, default=300.0)
    ap.add_argument("--resume-sec", type=float, default=30.0)
    ap.add_argument("--price", type=float, default=0.40)
    ap.add_argument("--scale-up-wait-sec", type=float, default=20.0)
    ap.add_argument("--idle-stop-sec", type=float, default=600.0)
    ap.add_argument("--stopped-destroy-sec", type=float, default=86400.0)
    ap.add_argument("--tick-sec", type=float, default=1.0)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    trace = day_trace(args.seed, args.hours, args.service_sec)
    market = Market(args.price, args.boot_sec, args.resume_sec)
    cap = 3 * args.price
    scaling = PoolSpec(0, 3, 900.0, (args.price,), args.scale_up_wait_sec, args.idle_stop_sec,
                       args.stopped_destroy_sec)
    legs: dict[str, Result] = {}
    took: dict[str, float] = {}
    for name, spec, warm, stopped in (("fixed 3", PoolSpec.fixed(3, 900.0, args.price), 3, 0),
                                      ("min 0, max 3", scaling, 0, 3),
                                      ("min 0, max 3, cold", scaling, 0, 0)):
        t0 = time.perf_counter()
        legs[name] = simulate(trace, spec, market, cap=cap, tick_sec=args.tick_sec, warm=warm, stopped=stopped)
        took[name] = time.perf_counter() - t0

    base = legs["fixed 3"].gpu_hours
    print(f"{len(trace)} requests over {args.hours:g} h (seed {args.seed}); boot {args.boot_sec:g} s, "
          f"resume {args.resume_sec:g} s, scale_up_wait_sec {args.scale_up_wait_sec:g}, "
          f"idle_stop_sec {args.idle_stop_sec:g}, cap ${cap:.2f}/h")
    print("| leg | GPU-hours (× fixed) | $ | wait p50 / p95 / max s | lost | rents / resumes / stops | peak $/h |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in legs.items():
        print(f"| {name} | {r.gpu_hours:.1f} ({r.gpu_hours / base:.2f}×) | {r.cost:.2f} | "
              f"{r.p(0.5):.1f} / {r.p(0.95):.1f} / {max(r.waits, default=0):.1f} | {r.lost} | "
              f"{r.rents} / {r.resumes} / {r.stops} | {r.max_spend:.2f} |")
    limit = args.scale_up_wait_sec + args.resume_sec
    misses = []
    for name in ("min 0, max 3", "min 0, max 3, cold"):
        r = legs[name]
        if r.gpu_hours > 0.5 * base:
            misses.append(f"{name}: {r.gpu_hours / base:.2f}× the fixed pool's GPU-hours (> 0.5×)")
        if r.p(0.95) > limit:
            misses.append(f"{name}: p95 wait {r.p(0.95):.1f} s > {limit:g} s")
        if r.lost:
            misses.append(f"{name}: {r.lost} lost")
    misses += [f"{n}: peak spend {r.max_spend:.2f} over the cap" for n, r in legs.items() if r.max_spend > cap + 1e-9]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": len(trace), "args": vars(args),
                       "legs": {n: {"gpu_hours": r.gpu_hours, "cost": r.cost, "p50": r.p(0.5), "p95": r.p(0.95),
                                    "max_wait": max(r.waits, default=0), "lost": r.lost, "rents": r.rents,
                                    "resumes": r.resumes, "stops": r.stops, "max_spend": r.max_spend,
                                    "sim_sec": took[n]} for n, r in legs.items()}}, f, indent=2)
    if misses:
        print("targets missed: " + "; ".join(misses))
        return 1
    print("targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
