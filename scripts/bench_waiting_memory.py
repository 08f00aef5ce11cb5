#!/usr/bin/env python3
"""What one waiting request costs the gateway in memory: N held clients on 0 free slots.

The node is bench_burst.py's node (its gate closed: the route's 2 slots stay busy), so every
other client waits in the gateway's queue. Two passes over the same daemon:

1. plain: (RSS with N waiting − RSS idle) ÷ waiting = KB of RSS per waiting request;
2. traced: the daemon runs under tracemalloc (a wrapper; slower and fatter, so not used for the
   RSS figure) and writes a snapshot when idle and when all wait; the difference, grouped by
   file:line, says which allocations a waiting request holds (aiohttp request, transport
   buffers, ticket, lease scope, SSE state), in bytes per waiting request.

    .venv/bin/python scripts/bench_waiting_memory.py [--clients 1000] [--top 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import bench_burst as bb
import benchlib as bl

# The daemon under tracemalloc: SIGUSR1 writes a snapshot to the next numbered file.
TRACE_WRAPPER = """
import os, signal, sys, tracemalloc
tracemalloc.start(int(os.environ.get("KL_TRACE_FRAMES", "1")))
count = [0]
def dump(signum, frame):
    count[0] += 1
    tracemalloc.take_snapshot().dump(os.environ["KL_TRACE_OUT"] + f".{count[0]}")
signal.signal(signal.SIGUSR1, dump)
from kilolined.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_daemon(procs: bl.Procs, port: int, node_url: str, n: int, traced: Path | None) -> Any:
    routes = {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 2, "max_queue_depth": n + 100,
                      "queue_timeout_sec": 600, "request_timeout_sec": 600}}
    if traced is None:
        proc, _ = bl.start_gateway(procs, bl.gateway_config(port, {"gpu": node_url}, routes), cpu=0)
        return proc
    path = procs.workdir / "traced.yaml"
    bl.write_yaml(path, bl.gateway_config(port, {"gpu": node_url}, routes))
    wrapper = procs.workdir / "tracewrap.py"
    wrapper.write_text(TRACE_WRAPPER)
    env = {**os.environ, "KL_TRACE_OUT": str(traced)}
    proc = procs.start([bl.PYTHON, str(wrapper), "--log-format", "text", "run", "-c", str(path)], "traced",
                       cpu=0, env=env)
    bl.wait_port(port, timeout=90.0, proc=proc)  # tracemalloc makes the start several times slower
    return proc


async def snapshot(proc: Any, out: Path, index: int) -> Any:
    import tracemalloc

    os.kill(proc.pid, signal.SIGUSR1)
    path = Path(f"{out}.{index}")
    deadline = time.monotonic() + 120
    last = -1
    while time.monotonic() < deadline:  # written when its size stops changing
        await asyncio.sleep(0.5)
        size = path.stat().st_size if path.exists() else -1
        if size > 0 and size == last:
            return tracemalloc.Snapshot.load(str(path))
        last = size
    raise TimeoutError(f"no tracemalloc snapshot from pid {proc.pid}")


def package_of(filename: str) -> str:
    """Who allocated it, in the terms that decide what can be cut: aiohttp, our code, the rest."""
    for name in ("kilolined", "aiohttp", "multidict", "yarl", "uvloop", "asyncio"):
        if f"/{name}/" in filename:
            return name
    return "other (stdlib, …)"


def by_package(diff: list[Any], waiting: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in diff:
        pkg = package_of(str(d.traceback[0].filename))
        out[pkg] = out.get(pkg, 0.0) + d.size_diff / max(1, waiting)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def hold(url: str, n: int, node_url: str, port: int, proc: Any, traced: Path | None,
               top: int) -> dict[str, Any]:
    import aiohttp

    out: dict[str, Any] = {"clients": n, "traced": traced is not None}
    ctl = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                    timeout=aiohttp.ClientTimeout(total=600))
    headers = {**bl.API_HDR, "Content-Type": "application/json"}
    outcomes: Any = __import__("collections").Counter()
    tasks: list[asyncio.Task[None]] = []
    try:
        await asyncio.gather(*(bl.post_counted(session, url, headers, outcomes) for _ in range(20)))
        await asyncio.sleep(1.0)
        idle_rss = await bb.rss_median(proc.pid)
        before = await snapshot(proc, traced, 1) if traced is not None else None
        await bb.post(ctl, node_url + "/_fake/gate", {"open": False})
        for i in range(n):
            tasks.append(asyncio.create_task(bl.post_counted(session, url, headers, outcomes)))
            if i % 200 == 199:
                await asyncio.sleep(0.02)
        waiting, deadline = 0, time.monotonic() + max(60.0, n / 20)
        while time.monotonic() < deadline and waiting < n - 2:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError):
                async with ctl.get(f"http://127.0.0.1:{port}/admin/state", headers=bl.ADMIN_HDR) as r:
                    waiting = int((await r.json())["routes"]["gen"]["queue_depth"])
            await asyncio.sleep(0.2)
        out["waiting"] = waiting
        await asyncio.sleep(0.5)
        full_rss = await bb.rss_median(proc.pid)
        out["rss_idle_kb"], out["rss_waiting_kb"] = idle_rss, full_rss
        out["kb_per_waiting"] = (full_rss - idle_rss) / waiting if waiting else None
        if traced is not None and before is not None:
            after = await snapshot(proc, traced, 2)
            diff = after.compare_to(before, "lineno")
            out["traced_bytes_per_waiting"] = sum(d.size_diff for d in diff) / max(1, waiting)
            out["by_package"] = by_package(after.compare_to(before, "filename"), waiting)
            out["top"] = [{"where": str(d.traceback[0]), "bytes_per_waiting": d.size_diff / max(1, waiting),
                           "blocks_per_waiting": d.count_diff / max(1, waiting)}
                          for d in diff[:top]]
        return out
    finally:
        with contextlib.suppress(Exception):
            await bb.post(ctl, node_url + "/_fake/gate", {"open": True})
        await asyncio.wait(tasks, timeout=60) if tasks else None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        await ctl.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--top", type=int, default=15, help="allocation sites to list")
    ap.add_argument("--no-trace", action="store_true", help="only the RSS pass")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n = args.clients
    bl.install_sigterm_exit()
    nofile = bl.raise_nofile()
    if nofile < 2 * n + 200:
        print(f"warning: RLIMIT_NOFILE is {nofile}; {n} clients need more", file=sys.stderr)
    machine = bl.print_machine()
    results = []
    with bl.workdir("waitmem") as wd, bl.Procs(wd) as procs:
        node_port = bl.free_port()
        node = procs.start([bl.PYTHON, bb.__file__, "--serve-node", str(node_port), "--step-ms", "1"], "node", cpu=1)
        bl.wait_port(node_port, proc=node)
        node_url = f"http://127.0.0.1:{node_port}"
        for traced in [None] if args.no_trace else [None, wd / "snap"]:
            port = bl.free_port()
            proc = start_daemon(procs, port, node_url, n, traced)
            res = bb.bl_run(hold(f"http://127.0.0.1:{port}/gen/generate", n, node_url, port, proc, traced, args.top))
            procs.stop(proc)
            results.append(res)
    plain = results[0]
    print(f"\n## Memory per waiting request ({n} held clients, 0 free slots)")
    print(f"  waiting {plain['waiting']}, RSS idle {plain['rss_idle_kb'] / 1024:.1f} MB, "
          f"all waiting {plain['rss_waiting_kb'] / 1024:.1f} MB -> "
          f"{plain['kb_per_waiting']:.1f} KB RSS per waiting request")
    if len(results) > 1 and "top" in results[1]:
        tr = results[1]
        print(f"  tracemalloc: {tr['traced_bytes_per_waiting'] / 1024:.1f} KB of Python allocations per waiting "
              f"request (the rest of the RSS is C buffers, allocator slack and the kernel's socket memory "
              f"is not counted)")
        print("  by who allocated it (bytes per waiting request): " +
              ", ".join(f"{k} {v:.0f}" for k, v in tr["by_package"].items()))
        bl.print_table(["allocated at", "bytes / waiting", "blocks / waiting"],
                       [[t["where"], t["bytes_per_waiting"], t["blocks_per_waiting"]] for t in tr["top"]], nd=1)
    bl.write_json(args.json, {"machine": machine, "clients": n, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
