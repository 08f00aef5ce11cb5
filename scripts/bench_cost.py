#!/usr/bin/env python3
"""A mixed burst on one simulated 24 GB card: fixed slots vs cost-aware admission, in one run.

The card (`FakeGPU`, `capacity_mode="request"`) gives every job the VRAM its request names
(`vram_gb`) and crashes with CUDA out of memory when the jobs running at once need more than
24 GB (every running job fails, the card is down `--crash-sec`). The same shuffled burst — 1 in 4
requests a large image (12 GB, 2× the steps), the rest small (3 GB) — is sent through the gateway
three ways:

- fixed `max_concurrency` chosen to be safe (the largest job fits N times: 24 ÷ 12 = 2);
- fixed `max_concurrency` chosen for throughput (what the small jobs would allow, here 6);
- cost-aware: `routes.r.cost: {per_unit: 1, unit: "json:/vram_gb"}` with `nodes.card.capacity: 22`
  (2 GB of headroom, as one would set it on a real card: two large jobs never run together) and
  with `capacity: 24` (the whole simulated card, which has no fragmentation); `max_concurrency: 8`
  still holds.

Per variant: requests served and failed, OOM crashes, jobs lost to OOM, peak VRAM, makespan (first
request sent → last answer), mean occupancy (∫ VRAM in use dt ÷ (24 GB × makespan), sampled every
10 ms in the card). Gateway and card run in this one process on loopback: the card's step time
(tens of ms) dwarfs the gateway's overhead (tens of µs per request, docs/BENCHMARKS.md).

    python scripts/bench_cost.py [--requests 200] [--step-ms 50] [--crash-sec 2] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import random
import sys
import time
from typing import Any

import aiohttp
import benchlib as bl
import yaml

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU

VRAM_GB, LARGE_GB, SMALL_GB = 24.0, 12.0, 3.0
SMALL_STEPS = 4
KEY = "kl_bench_cost_key_000000000000000000"


def config(card_url: str, variant: str) -> dict[str, Any]:
    route: dict[str, Any] = {"path": "/r", "nodes": ["card"], "max_queue_depth": 10_000, "queue_timeout_sec": 600,
                             "request_timeout_sec": 600, "retry_on_failover": 1}
    node: dict[str, Any] = {"url": card_url, "breaker": {"open_sec": 1, "slow_start_sec": 0}}
    if variant == "safe":
        route["max_concurrency"] = int(VRAM_GB // LARGE_GB)
    elif variant == "throughput":
        route["max_concurrency"] = 6
    else:
        route["max_concurrency"] = 8
        route["cost"] = {"base": 0, "per_unit": 1, "unit": "json:/vram_gb"}
        node["capacity"] = int(variant.removeprefix("cost-"))
    return {
        "server": {"listen": "127.0.0.1:0", "access_log": False},
        "keys": {"bench": {"key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}},
        "nodes": {"card": node},
        "routes": {"r": route},
    }


def workload(n: int, seed: int) -> list[float]:
    sizes = [LARGE_GB if i % 4 == 0 else SMALL_GB for i in range(n)]
    random.Random(seed).shuffle(sizes)
    return sizes


async def sample_vram(gpu: FakeGPU, out: list[tuple[float, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append((time.monotonic(), gpu.vram_used_gb))
        await asyncio.sleep(0.01)


async def run_variant(variant: str, sizes: list[float], step_ms: float, crash_sec: float) -> dict[str, Any]:
    gpu = FakeGPU("generic", capacity_mode="request", vram_gb=VRAM_GB, steps=SMALL_STEPS, step_ms=step_ms,
                  crash_sec=crash_sec)
    await gpu.start()
    text = yaml.safe_dump(config(gpu.url, variant))
    server = Server(parse_config(text, env={}), "bench", None)
    await server.start()
    url = f"http://127.0.0.1:{server.port}/r/generate"
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    statuses: list[str] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(gb: float) -> str:
                steps = SMALL_STEPS * (2 if gb == LARGE_GB else 1)
                try:
                    async with http.post(url, json={"vram_gb": gb, "steps": steps},
                                         headers={"Authorization": f"Bearer {KEY}"}) as r:
                        await r.read()
                        return str(r.status)
                except aiohttp.ClientError as e:
                    return type(e).__name__

            sampler = asyncio.create_task(sample_vram(gpu, samples, stop))
            t0 = time.monotonic()
            statuses = list(await asyncio.gather(*(one(gb) for gb in sizes)))
            makespan = time.monotonic() - t0
            stop.set()
            await sampler
    finally:
        await server.shutdown()
        stats = gpu.stats
        await gpu.stop()
    area = sum((b[0] - a[0]) * a[1] for a, b in itertools.pairwise(samples))
    return {
        "variant": variant,
        "served": statuses.count("200"),
        "failed": len(statuses) - statuses.count("200"),
        "oom_crashes": stats["crashes"],
        "oom_jobs": stats["oom_count"],
        "peak_vram_gb": stats["peak_vram_gb"],
        "max_concurrent": stats["max_concurrent"],
        "makespan_sec": round(makespan, 2),
        "mean_occupancy": round(area / (VRAM_GB * makespan), 3) if makespan else 0.0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["variant", "served", "failed", "oom_crashes", "oom_jobs", "peak_vram_gb", "max_concurrent",
            "makespan_sec", "mean_occupancy"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = workload(args.requests, args.seed)
    rows = []
    for variant in ("safe", "throughput", "cost-22", "cost-24"):
        rows.append(await run_variant(variant, sizes, args.step_ms, args.crash_sec))
        print(f"{variant}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=50)
    p.add_argument("--crash-sec", type=float, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    print(table(rows))
    bl.write_json(args.json, rows)
    safe = next(r for r in rows if r["variant"] == "safe")
    ok = all(r["oom_crashes"] == 0 and r["failed"] == 0 and r["makespan_sec"] < safe["makespan_sec"]
             for r in rows if r["variant"].startswith("cost-"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
