#!/usr/bin/env python3
"""Soak: mixed sync / sse / async traffic for `--minutes`, with the primary node killed (SIGKILL,
then restarted) every `--kill-every` rounds and the config flipped (max_concurrency 1 ↔ 3,
rewritten YAML + POST /admin/reload) every round. Per round: the gateway's RSS, outcomes, p95
queue wait, p95 duration. At the end: the RSS slope in MB/hour (least squares over the rounds
after the warm-up), and the idle check (no slot held, nothing queued).

`jobs.result_ttl_sec` is 60 here, so finished jobs leave memory within a round or two: memory
kept on purpose (results for their TTL) reaches its plateau early, and what still grows is a leak.

    .venv/bin/python scripts/soak.py [--quick] [--minutes 30] [--round-sec 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl
import chaos

RESULT_TTL_SEC = 60


def soak_config(port: int, nodes: dict[str, str], max_concurrency: int) -> dict[str, Any]:
    health = {"path": "/health", "interval_sec": 1, "timeout_sec": 1, "fall": 2, "rise": 2}
    breaker = {"consecutive_failures": 3, "open_sec": 2, "max_open_sec": 10, "slow_start_sec": 5}
    route = {"path": "/gen", "nodes": ["a"], "standby": ["b"], "max_concurrency": max_concurrency,
             "max_queue_depth": 500, "queue_timeout_sec": 30, "request_timeout_sec": 10, "retry_on_failover": 1}
    cfg = bl.gateway_config(port, {}, {"gen": route}, heartbeat_sec=2)
    cfg["nodes"] = {n: {"url": u, "health": health, "breaker": breaker} for n, u in nodes.items()}
    cfg["jobs"] = {"result_ttl_sec": RESULT_TTL_SEC}
    return cfg


async def soak(minutes: float, round_sec: float, workers: int, kill_every: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with bl.workdir("soak") as wd, bl.Procs(wd) as procs:
        nodes = {n: chaos.ProcNode(n, procs, bl.free_port(), steps=2, step_ms=25) for n in ("a", "b")}
        for n in nodes.values():
            await n.start()
        port = bl.free_port()
        base = f"http://127.0.0.1:{port}"
        urls = {n: h.url for n, h in nodes.items()}
        gw, cfg_path = await asyncio.to_thread(bl.start_gateway, procs, soak_config(port, urls, 1), "gateway", 0)
        traffic = chaos.Traffic(base, rng, workers, client_timeout=120, steps=(1, 3), step_ms=(10, 40),
                                stream_share=0.3)
        rss_start = bl.rss_kb(gw.pid)
        traffic.start()
        t0 = time.monotonic()
        n_rounds = max(2, math.ceil(minutes * 60 / round_sec))
        print(f"# {n_rounds} rounds of {round_sec:g} s, {workers} client loops, kill the primary every "
              f"{kill_every} rounds, flip max_concurrency 1↔3 every round; RSS at start {rss_start / 1024:.1f} MB")
        rounds: list[dict[str, Any]] = []
        seen = 0
        max_conc = 1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl:
            for r in range(n_rounds):
                start = t0 + r * round_sec
                max_conc = 3 if max_conc == 1 else 1
                bl.write_yaml(cfg_path, soak_config(port, urls, max_conc))
                async with ctl.post(base + "/admin/reload", headers=bl.ADMIN_HDR) as resp:
                    reload_status = resp.status
                killed = kill_every > 0 and r % kill_every == kill_every - 1
                if killed:
                    await asyncio.sleep(round_sec * 0.3)
                    await nodes["a"].kill()
                    await asyncio.sleep(min(5.0, round_sec * 0.2))
                    await nodes["a"].revive()
                await asyncio.sleep(max(0.0, start + round_sec - time.monotonic()))
                new = traffic.outcomes[seen:]
                seen = len(traffic.outcomes)
                waits = [o.queue_wait for o in new if o.queue_wait is not None]
                durs = [o.duration for o in new if o.kind == "ok"]
                kinds = Counter(o.kind for o in new)
                row = {"round": r + 1, "t_min": (time.monotonic() - t0) / 60, "rss_mb": bl.rss_kb(gw.pid) / 1024,
                       "fds": bl.fd_count(gw.pid), "requests": len(new), "ok": kinds.get("ok", 0),
                       "other": {k: v for k, v in kinds.items() if k != "ok"}, "max_concurrency": max_conc,
                       "killed_primary": killed, "reload": reload_status,
                       "p95_queue_wait_s": bl.percentile(waits, 95), "p95_duration_s": bl.percentile(durs, 95)}
                rounds.append(row)
                print(f"  round {row['round']:3d} t={row['t_min']:6.1f} min rss={row['rss_mb']:6.1f} MB "
                      f"fds={row['fds']:4d} req={row['requests']:5d} ok={row['ok']:5d} "
                      f"p95 wait={bl.fmt(row['p95_queue_wait_s'], 3)} s p95 dur={bl.fmt(row['p95_duration_s'], 3)} s"
                      f"{' KILL' if killed else ''} other={row['other']}", flush=True)
        await traffic.stop(drain_timeout=60)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl:
            deadline = time.monotonic() + 45
            while True:
                async with ctl.get(base + "/admin/state", headers=bl.ADMIN_HDR) as resp:
                    st = await resp.json()
                route = st["routes"]["gen"]
                if (route["inflight"] == 0 and route["queue_depth"] == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        return {"rounds": rounds, "rss_start_mb": rss_start / 1024, "idle": {"inflight": route["inflight"],
                "queue_depth": route["queue_depth"]}, "total": len(traffic.outcomes),
                "outcomes": dict(Counter(o.kind for o in traffic.outcomes))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes, 20 s rounds")
    ap.add_argument("--minutes", type=float, default=None, help="default 30 (quick 2)")
    ap.add_argument("--round-sec", type=float, default=None, help="default 60 (quick 20)")
    ap.add_argument("--workers", type=int, default=8, help="concurrent client loops")
    ap.add_argument("--kill-every", type=int, default=3, help="kill the primary every N rounds (0: never)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    minutes = args.minutes or (2.0 if args.quick else 30.0)
    round_sec = args.round_sec or (20.0 if args.quick else 60.0)
    bl.install_sigterm_exit()
    bl.raise_nofile()
    machine = bl.print_machine()
    try:
        import uvloop

        res = uvloop.run(soak(minutes, round_sec, args.workers, args.kill_every, args.seed))
    except ImportError:
        res = asyncio.run(soak(minutes, round_sec, args.workers, args.kill_every, args.seed))
    rounds = res["rounds"]
    print(f"\n## Soak: {minutes:g} min, {len(rounds)} rounds of {round_sec:g} s, {res['total']} requests")
    table = bl.print_table(
        ["round", "t min", "max_conc", "primary killed", "requests", "ok", "other outcomes", "p95 queue wait s",
         "p95 duration s", "RSS MB", "fds"],
        [[r["round"], r["t_min"], r["max_concurrency"], "yes" if r["killed_primary"] else "",
          r["requests"], r["ok"], ", ".join(f"{k}: {v}" for k, v in r["other"].items()) or "-",
          r["p95_queue_wait_s"], r["p95_duration_s"], r["rss_mb"], r["fds"]] for r in rounds], nd=2)
    # Warm-up: the rounds during which kept results (result_ttl_sec) are still piling up.
    warm = min(len(rounds) - 2, max(1, math.ceil(RESULT_TTL_SEC / round_sec)))
    warm = max(0, warm)
    xs = [r["t_min"] / 60 for r in rounds[warm:]]
    ys = [r["rss_mb"] for r in rounds[warm:]]
    slope_all = bl.slope([r["t_min"] / 60 for r in rounds], [r["rss_mb"] for r in rounds])
    slope = bl.slope(xs, ys)
    half = rounds[len(rounds) // 2:]
    slope_half = bl.slope([r["t_min"] / 60 for r in half], [r["rss_mb"] for r in half])
    print(f"\nRSS: start {res['rss_start_mb']:.1f} MB, end {rounds[-1]['rss_mb']:.1f} MB; least-squares slope "
          f"{bl.fmt(slope, 1)} MB/hour over rounds {warm + 1}–{len(rounds)} (after the {RESULT_TTL_SEC} s result "
          f"TTL warm-up), {bl.fmt(slope_all, 1)} MB/hour over all rounds; steady state (second half, rounds "
          f"{len(rounds) - len(half) + 1}–{len(rounds)}): {bl.fmt(slope_half, 1)} MB/hour, RSS "
          f"{min(r['rss_mb'] for r in half):.1f}–{max(r['rss_mb'] for r in half):.1f} MB")
    print(f"outcomes: {res['outcomes']}")
    print(f"idle after: {res['idle']} -> {'OK' if res['idle'] == {'inflight': 0, 'queue_depth': 0} else 'LEAK'}")
    bl.write_json(args.json, {"machine": machine, "minutes": minutes, "round_sec": round_sec, **res,
                              "slope_mb_per_hour": slope, "slope_all_mb_per_hour": slope_all,
                              "slope_second_half_mb_per_hour": slope_half, "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
