#!/usr/bin/env python3
"""Chat and batch on one OpenAI path: the chat's queue wait with and without batch traffic,
through routes that match the request, against one shared route (the naive baseline), in one run.

Two simulated OpenAI servers: `chat` and `big`. Chat traffic: `--chats` short requests, one every
`--gap-ms` (4 tokens each). Batch traffic: `--batches` 10 000-token prompts at once (50 tokens
each). Every token takes `--step-ms`. Variants:

- **match, chat only**: `llm-batch` (`match: {min_units: 8000}`, node `big`) and `llm-chat`
  (fallback, node `chat`) on `/v1`; only the chat traffic;
- **match, chat + batch**: the same routes, both traffics;
- **one route, chat + batch**: one route on `/v1` over both nodes (the same slots in total):
  chats queue behind the batch.

Per variant: the chats' queue wait (the gateway's `X-KiloLine-Queue-Wait-Ms`) p50 / p95 / max,
and the batch's makespan. Gateway and servers run in this one process on loopback.

    python scripts/bench_routes.py [--chats 200] [--gap-ms 20] [--batches 16] [--step-ms 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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

KEY = "kl_bench_routes_key_0000000000000000"
SLOTS = 4


def config(chat: str, big: str, variant: str) -> dict[str, Any]:
    common = {"path": "/v1", "kind": "openai", "max_concurrency": SLOTS, "max_queue_depth": 10_000,
              "queue_timeout_sec": 600, "strategy": "fifo"}
    if variant.startswith("match"):
        routes = {"llm-batch": {**common, "nodes": ["big"], "match": {"min_units": 8000},
                                "cost": {"unit": "tokens"}},
                  "llm-chat": {**common, "nodes": ["chat"]}}
    else:
        routes = {"llm": {**common, "nodes": ["chat", "big"]}}
    return {
        "server": {"listen": "127.0.0.1:0", "access_log": False},
        "keys": {"bench": {"key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}},
        "nodes": {"chat": {"url": chat + "/v1"}, "big": {"url": big + "/v1"}},
        "routes": routes,
    }


def pct(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=100)[q - 1], 1) if len(xs) > 1 else (xs[0] if xs else 0.0)


async def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    chat = FakeGPU("openai", step_ms=args.step_ms, ctx_size=100_000, job_vram_gb=1)
    big = FakeGPU("openai", step_ms=args.step_ms, ctx_size=100_000, job_vram_gb=1)
    await chat.start()
    await big.start()
    server = Server(parse_config(yaml.safe_dump(config(chat.url, big.url, variant)), env={}), "bench", None)
    await server.start()
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    hdr = {"Authorization": f"Bearer {KEY}"}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(text: str, tokens: int) -> tuple[int, float]:
                body = {"model": "fake-llm", "messages": [{"role": "user", "content": text}], "max_tokens": tokens}
                async with http.post(url, json=body, headers=hdr) as r:
                    await r.read()
                    return r.status, float(r.headers.get("X-KiloLine-Queue-Wait-Ms", "nan"))

            async def batch() -> float:
                t0 = time.monotonic()
                got = await asyncio.gather(*(one("word " * 10_000, 50) for _ in range(args.batches)))
                assert all(s == 200 for s, _ in got), got
                return time.monotonic() - t0

            async def chats() -> list[float]:
                tasks = []
                for _ in range(args.chats):
                    tasks.append(asyncio.create_task(one("hello there", 4)))
                    await asyncio.sleep(args.gap_ms / 1000)
                got = await asyncio.gather(*tasks)
                assert all(s == 200 for s, _ in got), got
                return [w for _, w in got]

            with_batch = not variant.endswith("chat only")
            b = asyncio.create_task(batch()) if with_batch else None
            waits = await chats()
            makespan = await b if b is not None else None
    finally:
        await server.shutdown()
        await chat.stop()
        await big.stop()
    return {"variant": variant, "chat_wait_p50_ms": pct(waits, 50), "chat_wait_p95_ms": pct(waits, 95),
            "chat_wait_max_ms": max(waits), "batch_makespan_sec": None if makespan is None else round(makespan, 2)}


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for variant in ("match, chat only", "match, chat + batch", "one route, chat + batch"):
        rows.append(await run_variant(variant, args))
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=20)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    print(table(rows))
    bl.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
