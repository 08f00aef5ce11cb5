#!/usr/bin/env python3
"""Slow-node watch (docs/CONFIG.md "Slow nodes"): three simulated GPUs under a steady load, one turning 3× slower
mid-run, with the detector on, with ``slow: off``, and with no fault at all.

Each node is `kilolined fakegpu` in its own process (a request costs `--steps` × `--step-ms`);
node c is started with `--slowdown 3 --slowdown-after-sec T`. The load is open-loop: requests
arrive at a fixed rate (`--rate` per second, Poisson), so a slow node cannot slow the arrivals
down, and every request's latency is measured by the client. Runs:

- **no fault**: the reference latencies;
- **fault, detector on**: the default `slow` settings;
- **fault, slow: off**: what the least-loaded choice alone does about it;
- **no fault, noise**: every request's `step_ms` drawn from a lognormal of σ 0.5 (the same
  distribution on every node) — the false alarms, which must be zero.

Reported: requests c served after it turned slow until the gateway flagged it (``slowed`` in
/admin/state, polled every 50 ms), c's share of the traffic in 5-second windows after the fault
and from 15 to 30 s after it, and the route's p50/p95/p99 after the fault (from the fault + 10 s
to the end, once the watch has had its say) against the no-fault run. The nodes' breaker is the
default one (``open_sec`` 10, doubling), so c's trials come within the run: ``--open-sec`` sets
another. The script exits non-zero unless: flagged within 10 of its requests, under 20 % of the
traffic 15–30 s after the fault, p95 within 1.2× of the no-fault run, and no false alarm.
``--runs on`` runs the fault with the detector alone (a quick look at the share).

    .venv/bin/python scripts/bench_slow.py [--seconds 60] [--fault-at 20] [--rate 30] [--open-sec 10]
                                           [--runs ref,on,off,noise] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

import aiohttp
import benchlib as bl


def node_cmd(port: int, args: argparse.Namespace, slowdown: float, after: float) -> list[str]:
    cmd = bl.fakegpu_cmd(port, steps=args.steps, step_ms=args.step_ms)
    if slowdown != 1:
        cmd += ["--slowdown", str(slowdown), "--slowdown-after-sec", str(after)]
    return cmd


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float,
              out: list[tuple[float, float, str, int]]) -> None:
    start = time.monotonic()
    try:
        async with session.post(url, json=body, headers=bl.API_HDR) as r:
            await r.read()
            out.append((start - t0, time.monotonic() - start, r.headers.get("X-KiloLine-Node", "?"), r.status))
    except aiohttp.ClientError:
        out.append((start - t0, time.monotonic() - start, "?", 0))


async def drive(args: argparse.Namespace, port: int, sigma: float, t0: float
                ) -> tuple[list[tuple[float, float, str, int]], dict[str, float], int]:
    """Open-loop arrivals for ``args.seconds``; polls /admin/state for slowed nodes meanwhile.
    Returns (requests, node -> first time seen slowed, polls)."""
    rnd = random.Random(args.seed)
    out: list[tuple[float, float, str, int]] = []
    flagged: dict[str, float] = {}
    base = f"http://127.0.0.1:{port}"
    polls = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        stop = asyncio.Event()

        async def poll() -> None:
            nonlocal polls
            while not stop.is_set():
                try:
                    async with s.get(base + "/admin/state", headers=bl.ADMIN_HDR) as r:
                        st = await r.json()
                    polls += 1
                    for n, v in st["nodes"].items():
                        if v.get("slowed") or (v.get("speed") or {}).get("state") not in (None, "ok"):
                            flagged.setdefault(n, time.monotonic() - t0)
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        tasks = []
        end = t0 + args.seconds
        nxt = time.monotonic()
        while nxt < end:
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            ms = args.step_ms * (rnd.lognormvariate(0, sigma) if sigma else 1.0)
            tasks.append(asyncio.create_task(one(s, base + "/gen/generate", {"steps": args.steps, "step_ms": ms},
                                                 t0, out)))
            nxt += rnd.expovariate(args.rate)
        await asyncio.gather(*tasks)
        stop.set()
        await poller
    return out, flagged, polls


def run(args: argparse.Namespace, name: str, fault: bool, slow: Any, sigma: float) -> dict[str, Any]:
    with bl.workdir("slow") as d, bl.Procs(d) as procs:
        ports = {n: bl.free_port() for n in ("a", "b", "c")}
        gw_port = bl.free_port()
        nodes = {n: {"url": f"http://127.0.0.1:{p}", "slow": slow,
                     **({"breaker": {"open_sec": args.open_sec}} if args.open_sec is not None else {})}
                 for n, p in ports.items()}
        routes = {"gen": {"path": "/gen", "nodes": list(ports), "max_concurrency": args.slots,
                          "queue_timeout_sec": 60, "request_timeout_sec": 60}}
        # The gateway first (it starts slowly on a busy box), then the cards: c's clock for the
        # fault starts with the load, give or take its own start.
        bl.start_gateway(procs, bl.gateway_config(gw_port, nodes, routes))
        for n, p in ports.items():
            procs.start(node_cmd(p, args, 3.0 if fault and n == "c" else 1.0, args.fault_at), n)
        bl.wait_port(ports["c"], timeout=60)
        t_start = time.monotonic()  # c's clock starts as it listens (give or take a few ms)
        for p in ports.values():
            bl.wait_port(p, timeout=60)
        t0 = time.monotonic()
        fault_t = t_start + args.fault_at - t0  # when c turned slow, on the client's clock
        reqs, flagged, _ = asyncio.run(drive(args, gw_port, sigma, t0))
        log = (d / "gateway.log").read_text(errors="replace")
    return summarize(name, reqs, flagged, fault_t if fault else None, args, log)


def summarize(name: str, reqs: list[tuple[float, float, str, int]], flagged: dict[str, float],
              fault_t: float | None, args: argparse.Namespace, log: str) -> dict[str, Any]:
    settle_from = (fault_t if fault_t is not None else args.fault_at) + 10
    after = [r for r in reqs if r[0] >= settle_from]
    lat = sorted(r[1] * 1000 for r in after)
    res: dict[str, Any] = {
        "run": name, "requests": len(reqs), "errors": sum(1 for r in reqs if r[3] != 200),
        "p50_ms": bl.percentile(lat, 50), "p95_ms": bl.percentile(lat, 95), "p99_ms": bl.percentile(lat, 99),
        "flagged": sorted(flagged), "alerts": log.count("🐢"),
    }
    if fault_t is not None:
        on_c = [r for r in reqs if r[2] == "c" and r[0] >= fault_t]
        t_flag = flagged.get("c")
        res["fault_at_s"] = round(fault_t, 1)
        res["flagged_after_s"] = None if t_flag is None else round(t_flag - fault_t, 2)
        # c's requests that started after the fault and finished before it was flagged
        res["requests_until_flagged"] = (None if t_flag is None else
                                         sum(1 for r in on_c if r[0] + r[1] <= t_flag))
        shares = []
        w = fault_t
        while w < args.seconds:
            win = [r for r in reqs if w <= r[0] < w + 5]
            shares.append(round(100 * sum(1 for r in win if r[2] == "c") / max(1, len(win)), 1))
            w += 5
        res["c_share_pct_per_5s"] = shares
        late = [r for r in reqs if fault_t + 15 <= r[0] < fault_t + 30]
        res["c_share_pct_15_30s"] = round(100 * sum(1 for r in late if r[2] == "c") / max(1, len(late)), 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--fault-at", type=float, default=20, help="c turns 3x slower this long after it starts")
    ap.add_argument("--rate", type=float, default=30, help="requests per second (Poisson arrivals)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=20)
    ap.add_argument("--slots", type=int, default=4, help="max_concurrency per node")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--open-sec", type=float, help="the nodes' breaker.open_sec (default: the product's)")
    ap.add_argument("--runs", default="ref,on,off,noise",
                    help="which runs: ref (no fault), on (fault, detector on), off (fault, slow: off), noise")
    ap.add_argument("--json")
    args = ap.parse_args()
    bl.print_machine()
    plan = {"ref": ("no fault", False, {}, 0.0), "on": ("fault, detector on", True, {}, 0.0),
            "off": ("fault, slow: off", True, False, 0.0), "noise": ("no fault, noise σ 0.5", False, {}, 0.5)}
    wanted = [w for w in args.runs.split(",") if w in plan]
    got = {w: run(args, *plan[w]) for w in wanted}
    bl.print_table(["run", "requests", "errors", "p50 ms", "p95 ms", "p99 ms", "flagged", "alerts"],
                   [[r["run"], r["requests"], r["errors"], r["p50_ms"], r["p95_ms"], r["p99_ms"],
                     ",".join(r["flagged"]) or "-", r["alerts"]] for r in got.values()])
    for w in ("on", "off"):
        if w in got:
            r = got[w]
            print(f"\n{r['run']}: fault at {r['fault_at_s']} s; c flagged after {r['flagged_after_s']} s, "
                  f"{r['requests_until_flagged']} of its requests")
            print(f"  c's share per 5 s after the fault: {r['c_share_pct_per_5s']}; "
                  f"15-30 s after it: {r['c_share_pct_15_30s']} %")
    bl.write_json(args.json, {"args": vars(args), "runs": list(got.values())})
    if set(wanted) != set(plan):
        return 0  # a partial run is a look, not a verdict
    ref, on, off, noise = (got[w] for w in ("ref", "on", "off", "noise"))
    ratio = on["p95_ms"] / ref["p95_ms"] if on["p95_ms"] and ref["p95_ms"] else None
    print(f"p95 after the fault: detector on {bl.fmt(on['p95_ms'])} ms, slow: off {bl.fmt(off['p95_ms'])} ms, "
          f"no fault {bl.fmt(ref['p95_ms'])} ms (on / no fault = {bl.fmt(ratio)})")
    print(f"false alarms in the no-fault noise run: {len(noise['flagged'])} flagged, {noise['alerts']} alerts")
    ok = (on["requests_until_flagged"] is not None and on["requests_until_flagged"] <= 10
          and on["c_share_pct_15_30s"] < 20 and ratio is not None and ratio <= 1.2
          and not noise["flagged"] and noise["alerts"] == 0 and not ref["flagged"])
    print("targets met" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
