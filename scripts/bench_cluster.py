"""Cluster mode against single mode, in the same run: added latency and CPU per request.

One fake GPU that answers at once; a single gateway (no ``cluster``), and two gateways of one
cluster on a redis-server (no persistence) in front of the same node. wrk drives each target at
the same connection counts; CPU per request is each process's CPU seconds over the requests it
served (the cluster figure adds the Redis server's share). A burst phase sends N concurrent
clients at 2 slots through the two cluster gateways and through the single one: wall time
against the ideal (N × service time / 2 slots). A jobs phase runs sse jobs (``--jobs``, 16 at a
time) through each target: time per job from submission to ``output_ready``, and CPU per job —
in cluster mode every job is also mirrored into Redis (state, events, result).

    .venv/bin/python scripts/bench_cluster.py [--quick] [--conc 1,16,64] [--burst 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl


def cluster_cfg(port: int, node: str, redis_url: str, gid: str, slots: int) -> dict[str, Any]:
    cfg = single_cfg(port, node, slots)
    cfg["cluster"] = {"redis_url": redis_url, "gateway_id": gid, "lease_ttl_sec": 10, "key_prefix": "bench:"}
    return cfg


def single_cfg(port: int, node: str, slots: int) -> dict[str, Any]:
    routes = {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": slots, "max_queue_depth": 100000,
                      "queue_timeout_sec": 600, "request_timeout_sec": 600}}
    return bl.gateway_config(port, {"gpu": node}, routes)


async def burst(urls: list[str], n: int, step_ms: float) -> dict[str, Any]:
    body = {"steps": 1, "step_ms": step_ms}
    headers = {"Authorization": f"Bearer {bl.API_KEY}"}
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as s:

        async def one(i: int) -> int:
            async with s.post(urls[i % len(urls)], json=body, headers=headers) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.monotonic() - t0
    ideal = n * step_ms / 1000 / 2
    return {"n": n, "ok": sum(1 for x in statuses if x == 200), "wall_sec": round(wall, 2),
            "ideal_sec": round(ideal, 2), "vs_ideal": round(wall / ideal, 3) if ideal else None}


async def sse_jobs(url: str, n: int, conc: int = 16) -> list[float]:
    """``n`` sse jobs, ``conc`` at a time: seconds from submission to the end of each stream."""
    headers = {"Authorization": f"Bearer {bl.API_KEY}", "X-KiloLine-Mode": "sse"}
    times: list[float] = []
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                async with s.post(url, json={"steps": 1, "step_ms": 0}, headers=headers) as r:
                    body = await r.read()
                if r.status == 200 and b"output_ready" in body:
                    times.append(time.perf_counter() - t0)

        await asyncio.gather(*(one() for _ in range(n)))
    return times


def jobs_phase(targets: dict[str, tuple[str, list[int]]], n: int) -> list[dict[str, Any]]:
    recs, rows = [], []
    for name, (url, pids) in targets.items():
        asyncio.run(sse_jobs(url, 50))  # warm-up
        cpu0 = [bl.cpu_seconds(p) for p in pids]
        times = asyncio.run(sse_jobs(url, n))
        cpu = [(bl.cpu_seconds(p) - c0) / max(1, len(times)) * 1e6 for p, c0 in zip(pids, cpu0, strict=True)]
        rec = {"target": name, "jobs": n, "ok": len(times),
               "p50_ms": round((bl.percentile(times, 50) or 0) * 1000, 2),
               "p99_ms": round((bl.percentile(times, 99) or 0) * 1000, 2),
               "gateway_cpu_us_per_job": round(cpu[0], 1),
               "redis_cpu_us_per_job": round(cpu[1], 1) if len(cpu) > 1 else None}
        recs.append(rec)
        rows.append([name, n, rec["ok"], rec["p50_ms"], rec["p99_ms"], rec["gateway_cpu_us_per_job"],
                     rec["redis_cpu_us_per_job"]])
    bl.print_table(["target", "sse jobs", "ok", "p50 ms", "p99 ms", "gw CPU µs/job", "redis CPU µs/job"], rows)
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s per point")
    ap.add_argument("--seconds", type=float, default=None, help="wrk duration per point (default 8, quick 3)")
    ap.add_argument("--conc", default="1,16,64", help="comma-separated wrk connection counts")
    ap.add_argument("--burst", type=int, default=2000, help="clients of the burst phase (0: skip)")
    ap.add_argument("--burst-step-ms", type=float, default=20, help="service time of one burst request")
    ap.add_argument("--jobs", type=int, default=1000, help="sse jobs of the jobs phase (0: skip)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    concs = [int(c) for c in args.conc.split(",")]
    bl.install_sigterm_exit()
    bl.raise_nofile()
    machine = bl.print_machine()
    out: dict[str, Any] = {"machine": machine, "wrk": [], "burst": []}
    with bl.workdir("cluster") as wd, bl.Procs(wd) as procs:
        node_port, redis_port, single_port, a_port, b_port = (bl.free_port() for _ in range(5))
        node = f"http://127.0.0.1:{node_port}"
        bl.start_fakegpu(procs, node_port, "node")
        rp = procs.start([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(wd)], "redis")
        bl.wait_port(redis_port, proc=rp)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        slots = 512  # the wrk phase measures the per-request cost, not queueing
        single, _ = bl.start_gateway(procs, single_cfg(single_port, node, slots), "single")
        gw_a, _ = bl.start_gateway(procs, cluster_cfg(a_port, node, redis_url, "a", slots), "cluster-a")
        bl.start_gateway(procs, cluster_cfg(b_port, node, redis_url, "b", slots), "cluster-b")
        script = bl.wrk_script(wd)
        targets = {"single": (f"http://127.0.0.1:{single_port}/gen/generate", [single.pid]),
                   "cluster": (f"http://127.0.0.1:{a_port}/gen/generate", [gw_a.pid, rp.pid])}
        for url, _ in targets.values():
            bl.run_wrk(url, script, 16, 2)  # warm-up
        rows = []
        for c in concs:
            for name, (url, pids) in targets.items():
                cpu0 = [bl.cpu_seconds(p) for p in pids]
                r = bl.run_wrk(url, script, c, seconds)
                cpu = [bl.cpu_seconds(p) - c0 for p, c0 in zip(pids, cpu0, strict=True)]
                per_req_us = [x / max(1, r["requests"]) * 1e6 for x in cpu]
                rec = {"target": name, "conc": c, "rps": round(r["rps"]), "p50_ms": r["p50_us"] / 1000,
                       "p99_ms": r["p99_us"] / 1000, "gateway_cpu_us_per_req": round(per_req_us[0], 1),
                       "redis_cpu_us_per_req": round(per_req_us[1], 1) if len(per_req_us) > 1 else None,
                       "errors": r["errors"]}
                out["wrk"].append(rec)
                rows.append([name, c, rec["rps"], rec["p50_ms"], rec["p99_ms"], rec["gateway_cpu_us_per_req"],
                             rec["redis_cpu_us_per_req"], rec["errors"]])
        bl.print_table(["target", "conc", "rps", "p50 ms", "p99 ms", "gw CPU µs/req", "redis CPU µs/req", "err"],
                       rows)
        if args.jobs:
            out["jobs"] = jobs_phase(targets, args.jobs)
        if args.burst:
            # The same 2 slots for the burst: restart the three gateways with max_concurrency 2.
            for p in list(procs.procs):
                if getattr(p, "kl_name", "") in ("single", "cluster-a", "cluster-b"):
                    procs.stop(p)
            for port in (single_port, a_port, b_port):
                bl.wait_closed(port)
            bl.start_gateway(procs, single_cfg(single_port, node, 2), "single")
            bl.start_gateway(procs, cluster_cfg(a_port, node, redis_url, "a", 2), "cluster-a")
            bl.start_gateway(procs, cluster_cfg(b_port, node, redis_url, "b", 2), "cluster-b")
            runs = {"single": [f"http://127.0.0.1:{single_port}/gen/generate"],
                    "cluster (2 gateways)": [f"http://127.0.0.1:{a_port}/gen/generate",
                                             f"http://127.0.0.1:{b_port}/gen/generate"]}
            brows = []
            for name, urls in runs.items():
                res = asyncio.run(burst(urls, args.burst, args.burst_step_ms))
                res["target"] = name
                out["burst"].append(res)
                brows.append([name, res["n"], res["ok"], res["wall_sec"], res["ideal_sec"], res["vs_ideal"]])
            bl.print_table(["target", "clients", "ok", "wall s", "ideal s", "× ideal"], brows)
    bl.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
