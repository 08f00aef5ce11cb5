#!/usr/bin/env python3
"""A 4-model workload on one node that swaps models: FIFO against collation, in one run.

One simulated multi-model OpenAI server (`kilolined fakegpu --kind openai --models m1,m2,m3,m4
--swap-ms N --warm-models 1`): it holds one model; a request for another waits `--swap-ms` before
its first byte while that model loads (what llama-swap and Ollama do, 25–35 s on real cards).
`--requests` chat requests ask for the four models in a seeded random order; the node takes one
at a time (`max_concurrency: 1`). They enter the gateway's queue one by one in that order while
the first holds the node, so both variants see exactly the same queue:

- **FIFO**: `max_swap_bypass: 0` — served in arrival order, a swap at every change of model;
- **collation**: `max_swap_bypass: 4` (the default) — a request warm on the node goes before a
  head that would swap, at most 4 times per head.

Per variant: swaps (the node's own count), makespan, queue wait p50 / p95 / max (the gateway's
`X-KiloLine-Queue-Wait-Ms`), and the most times one request was passed over while it was the head
(seen from outside: the requests admitted after it that were dispatched, after every earlier one,
before it). The script exits non-zero unless collation swaps less than FIFO and passes no
request over more than its bound.

    python scripts/bench_swap.py [--requests 60] [--swap-ms 300] [--step-ms 20] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import random
import statistics
import sys
import time
from typing import Any

import aiohttp
import benchlib as bl
import yaml

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU

KEY = "kl_bench_swap_key_00000000000000000000"
MODELS = ["m1", "m2", "m3", "m4"]
HOLD_TOKENS = 100  # the first request holds the node while the rest enter the queue


def config(url: str, bound: int) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "access_log": False},
        "keys": {"bench": {"key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}},
        "nodes": {"box": {"url": url, "models": MODELS, "warm_models": 1}},
        "routes": {"llm": {"path": "/v1", "kind": "openai", "nodes": ["box"], "max_concurrency": 1,
                           "max_queue_depth": 10_000, "queue_timeout_sec": 600, "request_timeout_sec": 600,
                           "strategy": "fifo", "max_swap_bypass": bound}},
    }


def pct(xs: list[float], q: int) -> float:
    return round(statistics.quantiles(xs, n=100)[q - 1], 1) if len(xs) > 1 else (xs[0] if xs else 0.0)


def passed_over(admitted: list[float], dispatched: list[float]) -> int:
    """The most times a request was passed over while it was the head (admission order = index)."""
    order = sorted(range(len(dispatched)), key=lambda i: dispatched[i])
    served_at = {i: k for k, i in enumerate(order)}
    worst = 0
    for i in range(len(admitted)):
        became_head = max((served_at[j] for j in range(i)), default=-1) + 1
        worst = max(worst, served_at[i] - became_head)
    return worst


async def run_variant(name: str, bound: int, models: list[str], args: argparse.Namespace) -> dict[str, Any]:
    gpu = FakeGPU("openai", models=MODELS, swap_ms=args.swap_ms, warm_models=1, steps=2, step_ms=args.step_ms,
                  job_vram_gb=1)
    await gpu.start()
    server = Server(parse_config(yaml.safe_dump(config(gpu.url, bound)), env={}), "bench", None)
    await server.start()
    rt = server.rt
    rq = rt.scheduler.routes["llm"]
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    hdr = {"Authorization": f"Bearer {KEY}"}
    # The gateway reads GET /running at start: it knows m1 is warm before the first request.
    while rt.scheduler.nodes["box"].models.warm is None:
        await asyncio.sleep(0.01)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(model: str, tokens: int) -> tuple[int, float, float]:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
                async with http.post(url, json=body, headers=hdr) as r:
                    await r.read()
                    return r.status, float(r.headers.get("X-KiloLine-Queue-Wait-Ms", "nan")), time.monotonic()

            t0 = time.monotonic()
            tasks, admitted = [], []
            for i, model in enumerate(models):
                admitted.append(time.monotonic())
                tasks.append(asyncio.create_task(one(model, HOLD_TOKENS if i == 0 else 2)))
                while len(rq.waiting) < i:  # in the queue before the next one is sent: one order
                    await asyncio.sleep(0.002)
            got = await asyncio.gather(*tasks)
            makespan = max(end for _, _, end in got) - t0
    finally:
        await server.shutdown()
        await gpu.stop()
    assert all(status == 200 for status, _, _ in got), got
    waits = [w for _, w, _ in got]
    dispatched = [a + w / 1000 for a, (_, w, _) in zip(admitted, got, strict=True)]
    return {"variant": name, "max_swap_bypass": bound, "swaps": gpu.stats["swaps"],
            "makespan_sec": round(makespan, 2), "wait_p50_ms": pct(waits, 50), "wait_p95_ms": pct(waits, 95),
            "wait_max_ms": max(waits), "most_passed_over": passed_over(admitted, dispatched)}


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    models = [rng.choice(MODELS) for _ in range(args.requests)]
    models[0] = MODELS[0]  # the holder asks for the warm model
    changes = sum(1 for a, b in itertools.pairwise(models) if a != b)
    print(f"workload: {''.join(m[1] for m in models)} ({changes} changes of model)", file=sys.stderr)
    rows = []
    for name, bound in (("FIFO", 0), ("collation", 4)):
        rows.append(await run_variant(name, bound, models, args))
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--swap-ms", type=float, default=300)
    p.add_argument("--step-ms", type=float, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    print(table(rows))
    bl.write_json(args.json, rows)
    fifo, coll = rows
    ok = coll["swaps"] < fifo["swaps"] and coll["most_passed_over"] <= coll["max_swap_bypass"]
    if not ok:
        print("FAIL: collation must swap less than FIFO and pass no request over more than its bound",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
