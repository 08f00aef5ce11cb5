#!/usr/bin/env python3
"""A burst of N held clients spread over the 2 gateways of one cluster, against a single gateway
in the same run: dispatch gap, RSS per waiting request, 0 lost and 0 leaked.

The node is bench_burst.py's (its own process, ``--serve-node``): it holds each job ``--step-ms``
and timestamps each job's start and end on one clock, so the dispatch gap (a slot freed at the
node → the next request arriving there) is exact. ``--slots`` is the route's ``max_concurrency``,
the one N of the cluster. Each phase (single: one gateway; cluster: two gateways on one
redis-server without persistence, clients alternating between them):

1. warm up, then read the gateways' (and Redis') idle RSS;
2. close the node's gate, so N requests hold the slots, and start the clients (one connection
   each, ramped);
3. wait until all the others wait (single: /admin/state queue_depth; cluster: the waiting count
   in Redis, the cluster's queue), read the RSS: (RSS all waiting − RSS idle) ÷ waiting;
4. open the gate and let the queue drain; every client's outcome is counted (lost: anything but
   a 200), then leaks are looked for: the node's running jobs, each gateway's in-flight leases
   and waiting requests, and in Redis the leases per node and the waiting count must all be 0.

    .venv/bin/python scripts/bench_cluster_burst.py [--clients 10000] [--slots 2] [--step-ms 5]
        [--phases single,cluster] [--trace-gap] [--json out.json]

The table gives the drain as a multiple of the ideal (N × step ÷ slots), and the gateways' and
redis-server's CPU per request over the drain. ``--trace-gap`` runs the cluster's gateways
through a wrapper that stamps each step of the hand-over (the gap's parts, p50 and p99) and
reads every script's and command's time inside Redis from its slow log (threshold 0 over the
drain, which itself costs Redis a little).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_burst as bb
import benchlib as bl

PREFIX = "burst:"

# The cluster gateways run through a wrapper (--trace-gap) that stamps, with time.monotonic()
# (one clock for every process on the box, like the node's timeline), each step of the
# hand-over: the node's answer complete, the slot released, the RELEASE script sent and
# answered, a grant taken (from a script's answer here, or by pub/sub from the other gateway),
# the waiter resumed, its request written. Each gateway writes its stamps at exit.
CLUSTER_GAP_WRAPPER = bb.GAP_WRAPPER.replace("from kilolined.cli import main", """
from kilolined.cluster import leases as _cl
stamps.update({"call": [], "answer": [], "own": [], "msg": []})
_in_answer = [False]
import asyncio
_orig_call = _cl.ClusterLeases._call
def _call(self, name, *a):
    res = _orig_call(self, name, *a)  # a coroutine (sent when awaited) or a future (sent already)
    if name != "RELEASE":
        return res
    stamps["call"].append(mono())
    if asyncio.isfuture(res):
        res.add_done_callback(lambda f: stamps["answer"].append(mono()))
        return res
    async def answered():
        out = await res
        stamps["answer"].append(mono())
        return out
    return answered()
_cl.ClusterLeases._call = _call
_orig_grants = _cl.ClusterLeases._grants
def _grants(self, items):
    _in_answer[0] = True
    try:
        return _orig_grants(self, items)
    finally:
        _in_answer[0] = False
_cl.ClusterLeases._grants = _grants
_orig_granted = _cl.ClusterLeases._granted
def _granted(self, *a):
    stamps["own" if _in_answer[0] else "msg"].append(mono())
    return _orig_granted(self, *a)
_cl.ClusterLeases._granted = _granted
from kilolined.cli import main""")


async def redis_exec_times(url: str) -> dict[str, Any]:
    """Per script (and command), how many ran over the drain and p50 / p99 / max of their time
    inside Redis (µs), from the slow log at threshold 0."""
    import hashlib

    from kilolined.cluster import scripts

    names = {hashlib.sha1(getattr(scripts, n).encode()).hexdigest(): n for n in dir(scripts) if n.isupper()}
    async with aioredis.from_url(url) as r:
        await r.config_set("slowlog-log-slower-than", 10000)
        log = await r.slowlog_get(-1)
    by: dict[str, list[float]] = {}
    for e in log:
        cmd = e["command"].decode(errors="replace").split(" ")
        name = names.get(cmd[1], cmd[1]) if cmd[0].upper() == "EVALSHA" and len(cmd) > 1 else cmd[0].upper()
        by.setdefault(name, []).append(float(e["duration"]))
    return {k: [len(v), bl.percentile(v, 50), bl.percentile(v, 99), max(v), sum(v) / 1000] for k, v in by.items()}


def start_traced(procs: bl.Procs, cfg: dict[str, Any], name: str) -> Any:
    path = procs.workdir / f"{name}.yaml"
    bl.write_yaml(path, cfg)
    wrapper = procs.workdir / "clgapwrap.py"
    wrapper.write_text(CLUSTER_GAP_WRAPPER)
    env = {**os.environ, "KL_GAP_OUT": str(procs.workdir / f"gapstamps-{name}.json")}
    proc = procs.start([bl.PYTHON, str(wrapper), "--log-format", "text", "run", "-c", str(path)], name, env=env)
    bl.wait_port(int(cfg["server"]["listen"].rsplit(":", 1)[1]), proc=proc)
    return proc


def cluster_gap_parts(stamps: dict[str, list[float]], timeline: list[list[float]]) -> dict[str, Any]:
    """p50 and p99 (ms) of each step of the cluster's hand-over, the gateways' stamps merged."""
    starts = [s for s, _ in timeline]
    ends = [e for _, e in timeline]
    nxt = bb._next_after
    grants = sorted(stamps["own"] + stamps["msg"])
    parts = {
        "node end → answer at gateway": nxt(ends, stamps["complete"]),
        "answer → slot released": nxt(stamps["complete"], stamps["release"]),
        "released → RELEASE sent": nxt(stamps["release"], stamps["call"]),
        "RELEASE sent → answered": nxt(stamps["call"], stamps["answer"]),
        "answered → grant taken (either gateway)": nxt(stamps["answer"], grants),
        "grant taken → waiter resumed": nxt(grants, stamps["resumed"]),
        "resumed → request written": nxt(stamps["resumed"], stamps["sent"]),
        "written → node handler starts": nxt(stamps["sent"], starts),
    }
    out: dict[str, Any] = {k: [bl.percentile(v, 50), bl.percentile(v, 99)] if v else None for k, v in parts.items()}
    out["grants own / by message"] = [len(stamps["own"]), len(stamps["msg"])]
    return out


def route(n: int, slots: int, timeout: float) -> dict[str, dict[str, Any]]:
    return {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": slots, "max_queue_depth": n + 100,
                    "queue_timeout_sec": timeout, "request_timeout_sec": timeout}}


async def admin_state(ctl: Any, port: int) -> dict[str, Any]:
    async with ctl.get(f"http://127.0.0.1:{port}/admin/state", headers=bl.ADMIN_HDR) as r:
        return await r.json()


async def run_phase(name: str, urls: list[str], pids: list[int], redis_pid: int | None, n: int, slots: int,
                    node_url: str, waiting_count: Callable[[Any], Awaitable[int]],
                    leaks: Callable[[Any], Awaitable[dict[str, int]]], timeout: float,
                    redis_url: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"target": name, "clients": n, "slots": slots, "gateways": len(urls)}
    outcomes: Counter[str] = Counter()
    ctl = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                    timeout=aiohttp.ClientTimeout(total=timeout))
    headers = {**bl.API_HDR, "Content-Type": "application/json"}
    tasks: list[asyncio.Task[None]] = []

    async def one(url: str) -> None:
        await bl.post_counted(session, url, headers, outcomes)

    def rss(pid_list: list[int]) -> float:
        return float(sum(bl.rss_kb(p) for p in pid_list))

    async def rss_median(pid_list: list[int]) -> float:
        samples = []
        for _ in range(3):
            samples.append(rss(pid_list))
            await asyncio.sleep(0.1)
        return sorted(samples)[1]

    try:
        await asyncio.gather(*(one(urls[i % len(urls)]) for i in range(40)))  # warm-up, gate open
        outcomes.clear()
        await bb.post(ctl, node_url + "/_fake/reset", {})
        await asyncio.sleep(1.0)
        out["rss_idle_kb"] = await rss_median(pids)
        out["redis_rss_idle_kb"] = await rss_median([redis_pid]) if redis_pid else None
        await bb.post(ctl, node_url + "/_fake/gate", {"open": False})
        t_start = time.monotonic()
        for i in range(n):
            tasks.append(asyncio.create_task(one(urls[i % len(urls)])))
            if i % 200 == 199:
                await asyncio.sleep(0.02)
        want = n - slots
        waiting, deadline = -1, time.monotonic() + max(60.0, n / 40)
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError):
                waiting = await waiting_count(ctl)
            if waiting >= want or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.1)
        out["all_waiting_after_sec"] = round(time.monotonic() - t_start, 2)
        out["waiting"] = waiting
        await asyncio.sleep(0.3)
        full = await rss_median(pids)
        out["rss_waiting_kb"] = full
        out["kb_per_waiting"] = (full - out["rss_idle_kb"]) / waiting if waiting > 0 else None
        if redis_pid:
            rfull = await rss_median([redis_pid])
            out["redis_kb_per_waiting"] = (rfull - out["redis_rss_idle_kb"]) / waiting if waiting > 0 else None
        cpu0 = sum(bl.cpu_seconds(p) for p in pids)
        rcpu0 = bl.cpu_seconds(redis_pid) if redis_pid else 0.0
        if redis_url:  # every command's time inside Redis, over the drain
            async with aioredis.from_url(redis_url) as r:
                await r.config_set("slowlog-max-len", 1_000_000)
                await r.slowlog_reset()
                await r.config_set("slowlog-log-slower-than", 0)
        t_open = time.monotonic()
        await bb.post(ctl, node_url + "/_fake/gate", {"open": True})
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        out["drain_sec"] = round(time.monotonic() - t_open, 2)
        out["gateways_cpu_ms_per_req"] = (sum(bl.cpu_seconds(p) for p in pids) - cpu0) * 1000 / max(1, n)
        out["redis_cpu_ms_per_req"] = ((bl.cpu_seconds(redis_pid) - rcpu0) * 1000 / max(1, n)) if redis_pid else None
        out["unfinished"] = len(pending)
        if redis_url:
            out["redis_exec_us"] = await redis_exec_times(redis_url)
        async with ctl.get(node_url + "/_fake/stats") as r:
            out["node"] = await r.json()
        async with ctl.get(node_url + "/_fake/timeline") as r:
            timeline = await r.json()
        out["_timeline"] = timeline
        gaps = bb.dispatch_gaps(timeline, slots)
        out["gap_ms"] = {"n": len(gaps), "p50": bl.percentile(gaps, 50), "p99": bl.percentile(gaps, 99),
                         "max": max(gaps) if gaps else None}
        out["outcomes"] = dict(outcomes)
        out["lost"] = n - outcomes.get("200", 0)
        # A release reaches Redis (and the gateway's counters) just after its response went out.
        left: dict[str, int] = {}
        for _ in range(50):
            left = await leaks(ctl)
            if not any(left.values()):
                break
            await asyncio.sleep(0.1)
        out["leaked"] = left
        return out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await bb.post(ctl, node_url + "/_fake/gate", {"open": True})
        await session.close()
        await ctl.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=10000)
    ap.add_argument("--slots", type=int, default=2, help="the route's max_concurrency (the node's N)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="how long the node holds each job")
    ap.add_argument("--phases", default="single,cluster")
    ap.add_argument("--timeout", type=float, default=900.0, help="client timeout (s)")
    ap.add_argument("--trace-gap", action="store_true", help="run the cluster gateways through a wrapper that "
                                                             "stamps each step of the hand-over; print the parts")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n, slots = args.clients, args.slots
    redis_bin = shutil.which("redis-server")
    phases = [p for p in args.phases.split(",") if p]
    if "cluster" in phases and redis_bin is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    bl.install_sigterm_exit()
    nofile = bl.raise_nofile()
    if nofile < n + 500:
        # Each client holds one socket here and one in its gateway (one process each: fine);
        # the gateways' max_connections is raised to n + 1000 so that /admin/state still gets in.
        print(f"warning: RLIMIT_NOFILE is {nofile}; {n} clients need about {n + 500}", file=sys.stderr)
    machine = bl.print_machine()
    print(f"# {n} clients, {slots} slots, node step {args.step_ms:g} ms, RLIMIT_NOFILE {nofile}")
    results = []
    with bl.workdir("cluster-burst") as wd, bl.Procs(wd) as procs:
        node_port = bl.free_port()
        node = procs.start([bl.PYTHON, str(Path(bb.__file__).resolve()), "--serve-node", str(node_port),
                            "--step-ms", str(args.step_ms)], "node")
        bl.wait_port(node_port, proc=node)
        node_url = f"http://127.0.0.1:{node_port}"
        for phase in phases:
            if phase == "single":
                port = bl.free_port()
                cfg = bl.gateway_config(port, {"gpu": node_url}, route(n, slots, args.timeout),
                                        max_connections=n + 1000)
                gw, _ = bl.start_gateway(procs, cfg, "single")
                gws, ports, redis_proc = [gw], [port], None

                async def waiting_count(ctl: Any, port: int = port) -> int:
                    return int((await admin_state(ctl, port))["routes"]["gen"]["queue_depth"])

                async def leaks(ctl: Any, port: int = port) -> dict[str, int]:
                    st = await admin_state(ctl, port)
                    async with ctl.get(node_url + "/_fake/stats") as r:
                        running = (await r.json())["running"]
                    return {"node_running": running, "gateway_inflight": st["routes"]["gen"]["inflight"],
                            "gateway_waiting": st["routes"]["gen"]["queue_depth"]}
            elif phase == "cluster":
                assert redis_bin is not None
                redis_port = bl.free_port()
                redis_proc = procs.start([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--dir", str(wd)], "redis")
                bl.wait_port(redis_port, proc=redis_proc)
                redis_url = f"redis://127.0.0.1:{redis_port}/0"
                ports, gws = [bl.free_port(), bl.free_port()], []
                for gid, port in zip("ab", ports, strict=True):
                    cfg = bl.gateway_config(port, {"gpu": node_url}, route(n, slots, args.timeout),
                                            max_connections=n + 1000)
                    cfg["cluster"] = {"redis_url": redis_url, "gateway_id": gid, "lease_ttl_sec": 10,
                                      "key_prefix": PREFIX}
                    if args.trace_gap:
                        gws.append(start_traced(procs, cfg, f"cluster-{gid}"))
                    else:
                        gws.append(bl.start_gateway(procs, cfg, f"cluster-{gid}")[0])
                async def waiting_count(ctl: Any, url: str = redis_url) -> int:
                    async with aioredis.from_url(url) as r:
                        return int(await r.get(PREFIX + "n:gen") or 0)

                async def leaks(ctl: Any, url: str = redis_url, ports: list[int] = ports) -> dict[str, int]:
                    async with aioredis.from_url(url) as r:
                        nin = sum(int(v) for v in (await r.hgetall(PREFIX + "nin")).values())
                        queued = int(await r.get(PREFIX + "n:gen") or 0)
                    states = [await admin_state(ctl, p) for p in ports]
                    async with ctl.get(node_url + "/_fake/stats") as resp:
                        running = (await resp.json())["running"]
                    return {"node_running": running, "redis_leases": nin, "redis_waiting": queued,
                            "gateway_inflight": sum(st["routes"]["gen"]["inflight"] for st in states),
                            "gateway_waiting": sum(st["routes"]["gen"]["queue_depth"] for st in states)}
            else:
                print(f"unknown phase {phase}")
                continue
            urls = [f"http://127.0.0.1:{p}/gen/generate" for p in ports]
            print(f"## {phase}: bursting {n} clients over {len(urls)} gateway(s) …", flush=True)
            res = bb.bl_run(run_phase(phase, urls, [g.pid for g in gws], redis_proc.pid if redis_proc else None,
                                      n, slots, node_url, waiting_count, leaks, args.timeout,
                                      redis_url if (redis_proc and args.trace_gap) else None))
            res["ideal_drain_sec"] = round(n * args.step_ms / 1000 / slots, 2)
            res["x_ideal"] = round(res["drain_sec"] / res["ideal_drain_sec"], 3)
            timeline = res.pop("_timeline")
            results.append(res)
            print(f"   {json.dumps(res)}", flush=True)
            for g in gws:
                procs.stop(g)
            if phase == "cluster" and args.trace_gap:
                stamps: dict[str, list[float]] = {}
                for gid in "ab":
                    with contextlib.suppress(OSError, ValueError):
                        for k, v in json.loads((wd / f"gapstamps-cluster-{gid}.json").read_text()).items():
                            stamps.setdefault(k, []).extend(v)
                            res.setdefault("stamps_per_gateway", {}).setdefault(gid, {})[k] = len(v)
                if stamps:
                    res["gap_parts_ms"] = cluster_gap_parts(stamps, timeline)
                    print("## Where the cluster's dispatch gap goes (p50, p99 of each step, ms)")
                    for k, v in res["gap_parts_ms"].items():
                        print(f"  {k:42s} {v}")
                print("## Inside Redis over the drain: runs, p50 / p99 / max µs, total ms")
                for k, v in sorted(res.get("redis_exec_us", {}).items(), key=lambda kv: -kv[1][4]):
                    print(f"  {k:12s} {v}")
            if redis_proc is not None:
                procs.stop(redis_proc)
            time.sleep(1.0)

    print(f"\n## Burst of {n} held clients → {slots} slots (node step {args.step_ms:g} ms)")
    rows = []
    for r in results:
        rows.append([r["target"], r["gateways"], r["clients"], r["outcomes"].get("200", 0), r["lost"],
                     sum(r["leaked"].values()), r["node"]["max_concurrent"], r["waiting"], r["kb_per_waiting"],
                     r.get("redis_kb_per_waiting"), r["gap_ms"]["p50"], r["gap_ms"]["p99"], r["gap_ms"]["max"],
                     r["drain_sec"], r["ideal_drain_sec"], r["x_ideal"], r["gateways_cpu_ms_per_req"],
                     r["redis_cpu_ms_per_req"]])
    table = bl.print_table(["target", "gateways", "clients", "served 200", "lost", "leaked", "node max conc",
                            "waiting seen", "gw KB / waiting", "redis KB / waiting", "gap p50 ms", "gap p99 ms",
                            "gap max ms", "drain s", "ideal s", "× ideal", "gw CPU ms/req",
                            "redis CPU ms/req"], rows, nd=2)
    for r in results:
        ok = r["lost"] == 0 and not any(r["leaked"].values()) and r["node"]["max_concurrent"] == slots
        print(f"  {r['target']}: lost {r['lost']}, leaked {r['leaked']}, node max {r['node']['max_concurrent']} "
              f"-> {'MET' if ok else 'MISSED'}")
    bl.write_json(args.json, {"machine": machine, "clients": n, "slots": slots, "step_ms": args.step_ms,
                              "results": results, "table": table, "pid": os.getpid()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
