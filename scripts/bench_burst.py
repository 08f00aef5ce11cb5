#!/usr/bin/env python3
"""A burst of N held clients against 2 slots: outcomes, exact concurrency, memory per waiter,
dispatch gap — through the gateway and, as the reference, through HAProxy (server maxconn 2).

The node is a tiny aiohttp server in its own process (this script with --serve-node) that holds
each job `--step-ms` and records when each job started and ended with time.monotonic() in that one
process, so the dispatch gap (a slot freed at the node → the next request arriving at the node)
is measured on one clock. Each phase:

1. warm up, then read the proxy's idle RSS;
2. close the node's gate, so the first 2 requests hold their slots, and start N clients (one
   connection each, ramped);
3. wait until the proxy holds all N-2 others waiting (gateway: /admin/state queue_depth; HAProxy:
   qcur from its stats page), read its RSS: (RSS all waiting − RSS idle) ÷ waiting = KB per waiter;
4. open the gate and let the queue drain; every client's outcome is counted; the node's
   max_concurrent (must be exactly 2) and its start/end timeline give the dispatch gaps.

    .venv/bin/python scripts/bench_burst.py [--quick] [--clients 2000] [--step-ms 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter, deque
from typing import Any

import benchlib as bl

# --------------------------------------------------------------------------- the node process


def serve_node(port: int, step_ms: float) -> int:
    from aiohttp import web

    state = {"running": 0, "max_concurrent": 0, "served": 0}
    timeline: list[tuple[float, float]] = []
    gate = asyncio.Event()
    gate.set()
    body = b'{"ok": true}'

    async def generate(request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        state["running"] += 1
        state["max_concurrent"] = max(state["max_concurrent"], state["running"])
        try:
            await request.read()
            await gate.wait()
            await asyncio.sleep(step_ms / 1000)
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
            timeline.append((t0, time.monotonic()))
            state["served"] += 1
            return resp
        finally:
            state["running"] -= 1

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(state)

    async def reset(request: web.Request) -> web.Response:
        state["max_concurrent"] = state["running"]
        state["served"] = 0
        timeline.clear()
        return web.json_response(state)

    async def set_gate(request: web.Request) -> web.Response:
        data = await request.json()
        gate.set() if data.get("open") else gate.clear()
        return web.json_response({"open": gate.is_set()})

    async def get_timeline(request: web.Request) -> web.Response:
        return web.json_response(timeline)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/_fake/stats", stats)
    app.router.add_post("/_fake/reset", reset)
    app.router.add_post("/_fake/gate", set_gate)
    app.router.add_get("/_fake/timeline", get_timeline)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)
    return 0


# --------------------------------------------------------------------------- the gap's parts

# The gateway run through a wrapper (--trace-gap) that stamps, with time.monotonic() (one clock
# for every process on the box, like the node's timeline), each step of the hand-over from one
# job to the next: the node's answer complete at the gateway, the slot released, the next
# waiter resumed with its lease, its request written to the node socket. Written at exit.
GAP_WRAPPER = """
import atexit, json, os, sys, time
from kilolined.scheduling import lease
from kilolined.wire import upstream
stamps = {"complete": [], "release": [], "resumed": [], "sent": []}
mono = time.monotonic
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(self, *a, **k):
        if key != "complete" or (self.status and not self._eof):
            stamps[key].append(mono())
        return orig(self, *a, **k)
    setattr(cls, name, f)
wrap(upstream.UpstreamResponse, "on_message_complete", "complete")
wrap(lease.LeaseScope, "_release", "release")
wrap(lease.LeaseScope, "_got", "resumed")
wrap(upstream._Conn, "send", "sent")
def dump():
    with open(os.environ["KL_GAP_OUT"], "w") as fh:
        json.dump(stamps, fh)
atexit.register(dump)
from kilolined.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_traced_gateway(procs: bl.Procs, cfg: dict[str, Any], cpu: int | None) -> Any:
    path = procs.workdir / "gateway.yaml"
    bl.write_yaml(path, cfg)
    wrapper = procs.workdir / "gapwrap.py"
    wrapper.write_text(GAP_WRAPPER)
    env = {**os.environ, "KL_GAP_OUT": str(procs.workdir / "gapstamps.json")}
    proc = procs.start([bl.PYTHON, str(wrapper), "--log-format", "text", "run", "-c", str(path)], "gateway",
                       cpu=cpu, env=env)
    bl.wait_port(int(cfg["server"]["listen"].rsplit(":", 1)[1]), proc=proc)
    return proc


def _next_after(src: list[float], dst: list[float]) -> list[float]:
    """For each stamp in ``src``, ms to the first stamp in ``dst`` at or after it."""
    import bisect

    dst = sorted(dst)
    out = []
    for t in sorted(src):
        i = bisect.bisect_left(dst, t)
        if i < len(dst):
            out.append((dst[i] - t) * 1000)
    return out


def gap_parts(stamps: dict[str, list[float]], timeline: list[list[float]]) -> dict[str, float | None]:
    """p50 (ms) of each step of the hand-over: node end → answer complete at the gateway →
    slot released → next waiter resumed → its request written → the node's handler starts."""
    starts = [s for s, _ in timeline]
    ends = [e for _, e in timeline]
    parts = {
        "node end → answer at gateway": _next_after(ends, stamps["complete"]),
        "answer → slot released": _next_after(stamps["complete"], stamps["release"]),
        "released → next waiter resumed": _next_after(stamps["release"], stamps["resumed"]),
        "resumed → request written": _next_after(stamps["resumed"], stamps["sent"]),
        "written → node handler starts": _next_after(stamps["sent"], starts),
    }
    return {k: bl.percentile(v, 50) if v else None for k, v in parts.items()}


# --------------------------------------------------------------------------- measurements


def dispatch_gaps(timeline: list[list[float]], slots: int = 2) -> list[float]:
    """Gap between a slot freeing at the node and the next request starting there (ms).

    Every start after the first `slots` ones took a slot some end freed; ends are consumed in
    order (FIFO), which is exact for a busy queue with a fixed number of slots.
    """
    events = sorted([(s, 1) for s, _ in timeline] + [(e, 0) for _, e in timeline])
    ends: deque[float] = deque()
    started = 0
    gaps = []
    for t, kind in events:
        if kind == 0:
            ends.append(t)
            continue
        started += 1
        if started <= slots:
            continue
        if ends:
            gaps.append((t - ends.popleft()) * 1000)
    return gaps


async def post(ctl: Any, url: str, body: Any) -> Any:
    async with ctl.post(url, json=body) as r:
        return await r.json()


async def rss_median(pid: int, n: int = 3) -> float:
    samples = []
    for _ in range(n):
        samples.append(bl.rss_kb(pid))
        await asyncio.sleep(0.1)
    return statistics.median(samples)


def ideal_drain_sec(n: int, step_ms: float, slots: int = 2) -> float:
    """The drain with no gap at all: every slot busy back to back from the gate opening on."""
    return -(-n // slots) * step_ms / 1000


async def run_burst(target: str, url: str, n: int, proxy_pid: int, node_url: str, waiting_count: Any,
                    timeout: float, step_ms: float) -> dict[str, Any]:
    import aiohttp

    out: dict[str, Any] = {"target": target, "clients": n}
    outcomes: Counter[str] = Counter()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    ctl = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout))
    headers = {**bl.API_HDR, "Content-Type": "application/json"}
    tasks: list[asyncio.Task[None]] = []

    async def one() -> None:
        await bl.post_counted(session, url, headers, outcomes)

    try:
        # Warm-up (gate open): code paths loaded, pools filled; then the idle baseline.
        warm = [asyncio.create_task(one()) for _ in range(20)]
        await asyncio.gather(*warm)
        outcomes.clear()
        await post(ctl, node_url + "/_fake/reset", {})
        await asyncio.sleep(1.0)
        idle = await rss_median(proxy_pid)
        out["rss_idle_kb"] = idle
        await post(ctl, node_url + "/_fake/gate", {"open": False})
        t_start = time.monotonic()
        for i in range(n):
            tasks.append(asyncio.create_task(one()))
            if i % 200 == 199:
                await asyncio.sleep(0.02)
        want = n - 2
        waiting, deadline = -1, time.monotonic() + max(60.0, n / 50)
        last_change = time.monotonic()
        while time.monotonic() < deadline:
            try:
                now_waiting = await waiting_count(ctl)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError):
                now_waiting = waiting  # a busy proxy may be slow to answer its stats: keep going
            if now_waiting != waiting:
                waiting, last_change = now_waiting, time.monotonic()
            # All in; or (a proxy whose maxconn is below N) no longer growing for 3 s.
            if waiting >= want or all(t.done() for t in tasks) or (waiting > 0 and time.monotonic() - last_change > 3):
                break
            await asyncio.sleep(0.1)
        out["all_waiting_after_sec"] = time.monotonic() - t_start
        out["waiting"] = waiting
        await asyncio.sleep(0.3)
        full = await rss_median(proxy_pid)
        out["rss_waiting_kb"] = full
        out["kb_per_waiting"] = (full - idle) / waiting if waiting > 0 else None
        cpu0 = bl.cpu_seconds(proxy_pid)
        t_open = time.monotonic()
        await post(ctl, node_url + "/_fake/gate", {"open": True})
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        out["drain_sec"] = time.monotonic() - t_open
        out["ideal_sec"] = ideal_drain_sec(n, step_ms)
        out["ratio_vs_ideal"] = out["drain_sec"] / out["ideal_sec"]
        out["proxy_cpu_ms_per_req"] = (bl.cpu_seconds(proxy_pid) - cpu0) * 1000 / max(1, n)
        out["unfinished"] = len(pending)
        async with ctl.get(node_url + "/_fake/stats") as r:
            out["node"] = await r.json()
        async with ctl.get(node_url + "/_fake/timeline") as r:
            timeline = await r.json()
        out["_timeline"] = timeline
        gaps = dispatch_gaps(timeline)
        out["gap_ms"] = {"n": len(gaps), "p50": bl.percentile(gaps, 50), "p99": bl.percentile(gaps, 99),
                         "max": max(gaps) if gaps else None}
        out["outcomes"] = dict(outcomes)
        return out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await post(ctl, node_url + "/_fake/gate", {"open": True})
        await session.close()
        await ctl.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 clients")
    ap.add_argument("--clients", type=int, default=None, help="held clients (default 2000, quick 500)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="how long the node holds each job")
    ap.add_argument("--targets", default="gateway,haproxy")
    ap.add_argument("--timeout", type=float, default=600.0, help="client timeout (s)")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--gc-stats", action="store_true", help="run the gateway through a wrapper that records "
                                                            "cyclic-GC pauses and print them")
    ap.add_argument("--gc-freeze", action="store_true", help="experiment: gc.freeze() in the gateway once it "
                                                             "listens (implies --gc-stats)")
    ap.add_argument("--gc-no-freeze", action="store_true", help="experiment: make the daemon's own gc.freeze() "
                                                                "a no-op (implies --gc-stats)")
    ap.add_argument("--trace-gap", action="store_true", help="run the gateway through a wrapper that stamps "
                                                             "each step of the hand-over and print the parts")
    ap.add_argument("--json")
    ap.add_argument("--serve-node", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_node:
        return serve_node(args.serve_node, args.step_ms)
    n = args.clients or (500 if args.quick else 2000)
    targets = [t for t in args.targets.split(",") if t]
    bl.install_sigterm_exit()
    nofile = bl.raise_nofile()
    if nofile < n + 200:
        print(f"warning: RLIMIT_NOFILE is {nofile}; {n} clients need more", file=sys.stderr)
    machine = bl.print_machine()
    print(f"# {n} clients, 2 slots, node step {args.step_ms:g} ms, RLIMIT_NOFILE {nofile}")
    proxy_cpu = None if args.no_pin else 0
    load_cpu = None if args.no_pin else 1
    results = []
    with bl.workdir("burst") as wd, bl.Procs(wd) as procs:
        node_port = bl.free_port()
        node = procs.start([bl.PYTHON, os.path.abspath(__file__), "--serve-node", str(node_port),
                            "--step-ms", str(args.step_ms)], "node", cpu=load_cpu)
        bl.wait_port(node_port, proc=node)
        node_url = f"http://127.0.0.1:{node_port}"
        if load_cpu is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {load_cpu})
        for target in targets:
            port = bl.free_port()
            if target == "gateway":
                routes = {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 2,
                                  "max_queue_depth": n + 100, "queue_timeout_sec": args.timeout,
                                  "request_timeout_sec": args.timeout}}
                cfg = bl.gateway_config(port, {"gpu": node_url}, routes)
                if args.trace_gap:
                    proc = start_traced_gateway(procs, cfg, proxy_cpu)
                else:
                    proc, _ = bl.start_gateway(procs, cfg, cpu=proxy_cpu, gc_trace=args.gc_stats,
                                               gc_freeze=args.gc_freeze, gc_no_freeze=args.gc_no_freeze)
                url = f"http://127.0.0.1:{port}/gen/generate"

                async def waiting_count(ctl: Any, port: int = port) -> int:
                    async with ctl.get(f"http://127.0.0.1:{port}/admin/state", headers=bl.ADMIN_HDR) as r:
                        return int((await r.json())["routes"]["gen"]["queue_depth"])
            elif target == "haproxy":
                stats_port = bl.free_port()
                maxconn = min(n + 100, bl.haproxy_max_maxconn())
                if maxconn < n:
                    print(f"note: haproxy maxconn {maxconn} (fd hard limit); {n - maxconn} clients wait in the "
                          "listen backlog instead of its queue")
                try:
                    proc = bl.start_haproxy(procs, port, node_port, cpu=proxy_cpu, server_maxconn=2,
                                            global_maxconn=maxconn, stats_port=stats_port)
                except (RuntimeError, TimeoutError) as e:
                    print(f"haproxy did not start: {e}\n{procs.log_tail('haproxy')}")
                    continue
                url = f"http://127.0.0.1:{port}/generate"

                async def waiting_count(ctl: Any, stats_port: int = stats_port) -> int:
                    rows = await asyncio.to_thread(bl.haproxy_stats, stats_port)
                    return sum(int(r.get("qcur") or 0) for r in rows if r.get("pxname") == "be"
                               and r.get("svname") == "BACKEND")
            else:
                print(f"unknown target {target}")
                continue
            print(f"## {target}: bursting {n} clients …", flush=True)
            res = bl_run(run_burst(target, url, n, proc.pid, node_url, waiting_count, args.timeout, args.step_ms))
            results.append(res)
            timeline = res.pop("_timeline", [])
            procs.stop(proc)
            if target == "gateway" and args.trace_gap:
                with contextlib.suppress(OSError, ValueError):
                    res["gap_parts_p50_ms"] = gap_parts(json.loads((wd / "gapstamps.json").read_text()), timeline)
            print(f"   {json.dumps(res)}", flush=True)
            if target == "gateway" and (args.gc_stats or args.gc_freeze or args.gc_no_freeze):
                res["gc"] = bl.gc_stats((wd / "gateway.log").read_text(errors="replace"))
            time.sleep(1.0)

    print(f"\n## Burst of {n} held clients → 2 slots (node step {args.step_ms:g} ms)")
    rows = []
    for r in results:
        served = r["outcomes"].get("200", 0)
        other = {k: v for k, v in r["outcomes"].items() if k != "200"}
        rows.append([r["target"], n, served, ", ".join(f"{k}: {v}" for k, v in other.items()) or "none",
                     r["node"]["max_concurrent"], r["waiting"], r["rss_idle_kb"] / 1024, r["rss_waiting_kb"] / 1024,
                     r["kb_per_waiting"], r["gap_ms"]["p50"], r["gap_ms"]["p99"], r["gap_ms"]["max"], r["drain_sec"],
                     r["ratio_vs_ideal"], r["proxy_cpu_ms_per_req"]])
    table = bl.print_table(["target", "clients", "served 200", "other outcomes", "node max conc", "waiting seen",
                            "RSS idle MB", "RSS all waiting MB", "KB / waiting", "gap p50 ms", "gap p99 ms",
                            "gap max ms", "drain s", "× ideal", "proxy CPU ms/req"], rows, nd=2)
    gw = next((r for r in results if r["target"] == "gateway"), None)
    if gw is not None and gw.get("gap_parts_p50_ms"):
        print("\n## Where the gateway's dispatch gap goes (p50 of each step, ms)")
        for k, v in gw["gap_parts_p50_ms"].items():
            print(f"  {k:34s} {v:.3f}" if v is not None else f"  {k:34s} -")
    if gw is not None and gw.get("gc"):
        how = " (wrapper: gc.freeze() after start)" if args.gc_freeze else \
            " (wrapper: the daemon's gc.freeze() disabled)" if args.gc_no_freeze else ""
        print(f"\n## Gateway cyclic-GC pauses over the run{how}")
        for line in gw["gc"]:
            print(f"  {line}")
    if gw is not None:
        print("\n## Targets")
        ok = gw["outcomes"].get("200", 0) == n
        print(f"  all served: {gw['outcomes']} -> {'MET' if ok else 'MISSED'}")
        print(f"  node max concurrency {gw['node']['max_concurrent']} (must be exactly 2) -> "
              f"{'MET' if gw['node']['max_concurrent'] == 2 else 'MISSED'}")
        kb = gw["kb_per_waiting"]
        if kb is not None:
            print(f"  {kb:.1f} KB RSS per waiting request (target ≤ 16) -> {'MET' if kb <= 16 else 'MISSED'}")
        p99 = gw["gap_ms"]["p99"]
        if p99 is not None:
            print(f"  dispatch gap p99 {p99:.2f} ms (target ≤ 2 ms) -> {'MET' if p99 <= 2 else 'MISSED'}")
    bl.write_json(args.json, {"machine": machine, "clients": n, "step_ms": args.step_ms, "results": results,
                              "table": table})
    return 0


def bl_run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
