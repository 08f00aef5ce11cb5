#!/usr/bin/env python3
"""M waiting SSE jobs behind a hanging node: gateway CPU, heartbeat jitter, memory growth.

The node (`kilolined fakegpu`, `hang` knob on) never answers, the route has 1 slot, so one job
is `running` and M-1 are `queued`; `server.heartbeat_sec` is 1. One client process holds all M
streams on raw asyncio connections (a protocol that only counts `event: heartbeat` lines and
timestamps them, so the client adds next to no lag of its own). After every stream got its
`queued` event and a settle time, a measurement window reads:

- the gateway's CPU (utime+stime from /proc/<pid>/stat) over the window, as % of one core;
- per stream, the inter-arrival of `event: heartbeat` minus 1 s (the jitter), p50/p99/max;
- the gateway's RSS at the start and end of the window (the per-job replay log grows with
  every heartbeat/queue_status until REPLAY_KEEP events).

    .venv/bin/python scripts/bench_sse.py [--quick] [--jobs 1000] [--window 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from typing import Any

import benchlib as bl

HEARTBEAT = b"event: heartbeat\n"
QUEUED = b"event: queued\n"
TAIL = max(len(HEARTBEAT), len(QUEUED)) - 1


class SSEStream(asyncio.Protocol):
    """Counts heartbeats (with their arrival time) and notes the queued event; nothing else."""

    def __init__(self) -> None:
        self.tail = b""
        self.beats: list[float] = []
        self.queued = False
        self.bytes = 0
        self.closed = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        self.bytes += len(data)
        d = self.tail + data
        n = d.count(HEARTBEAT)
        if n:
            self.beats.extend([now] * n)
        if not self.queued and QUEUED in d:
            self.queued = True
        self.tail = d[-TAIL:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


async def open_streams(port: int, m: int, body: bytes) -> list[SSEStream]:
    loop = asyncio.get_running_loop()
    req = (f"POST /gen/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {bl.API_KEY}\r\n"
           f"X-KiloLine-Mode: sse\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
           ).encode() + body
    streams: list[SSEStream] = []

    async def one() -> None:
        _, proto = await loop.create_connection(SSEStream, "127.0.0.1", port)
        assert proto.transport is not None
        proto.transport.write(req)
        streams.append(proto)

    batch = 200
    for i in range(0, m, batch):
        res = await asyncio.gather(*(one() for _ in range(min(batch, m - i))), return_exceptions=True)
        errs = [r for r in res if isinstance(r, BaseException)]
        if errs:
            print(f"  {len(errs)} connections failed, e.g. {errs[0]!r}", file=sys.stderr)
        await asyncio.sleep(0.02)
    return streams


async def measure(gw_pid: int, port: int, m: int, window: float, settle: float,
                  profile_to: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": m, "window_sec": window}
    rss0 = bl.rss_kb(gw_pid)
    t0 = time.monotonic()
    streams = await open_streams(port, m, b'{"steps": 0}')
    try:
        deadline = time.monotonic() + max(60.0, m / 50)
        while time.monotonic() < deadline and sum(s.queued for s in streams) < len(streams):
            await asyncio.sleep(0.1)
        out["connected"] = len(streams)
        out["queued_seen"] = sum(s.queued for s in streams)
        out["all_queued_after_sec"] = time.monotonic() - t0
        await asyncio.sleep(settle)
        spy = bl.pyspy_record(gw_pid, window, profile_to) if profile_to is not None else None
        w0 = time.monotonic()
        cpu0, rss_w0 = bl.cpu_seconds(gw_pid), bl.rss_kb(gw_pid)
        await asyncio.sleep(window)
        if spy is not None:
            await asyncio.to_thread(spy.wait, window + 30)
        w1 = time.monotonic()
        cpu1, rss_w1 = bl.cpu_seconds(gw_pid), bl.rss_kb(gw_pid)
        out["gateway_cpu_pct"] = 100 * (cpu1 - cpu0) / (w1 - w0)
        out["rss_idle_mb"] = rss0 / 1024
        out["rss_window_start_mb"] = rss_w0 / 1024
        out["rss_window_end_mb"] = rss_w1 / 1024
        out["rss_growth_kb_per_job_per_min"] = (rss_w1 - rss_w0) / max(1, m) / ((w1 - w0) / 60)
        jitter: list[float] = []
        beats_in_window = 0
        silent = 0
        for s in streams:
            ts = [t for t in s.beats if w0 <= t <= w1]
            beats_in_window += len(ts)
            if not ts:
                silent += 1
            jitter.extend((b - a - 1.0) * 1000 for a, b in itertools.pairwise(ts))
        out["heartbeats_per_sec"] = beats_in_window / (w1 - w0)
        # Each heartbeat of a queued job comes with a queue_status: both go to the job's replay log.
        out["rss_growth_bytes_per_logged_event"] = (rss_w1 - rss_w0) * 1024 / max(1, 2 * beats_in_window)
        out["streams_without_heartbeat"] = silent
        out["closed_streams"] = sum(s.closed for s in streams)
        out["jitter_ms"] = {"n": len(jitter), "p50": bl.percentile(jitter, 50), "p99": bl.percentile(jitter, 99),
                            "max": max(jitter) if jitter else None, "min": min(jitter) if jitter else None}
        return out
    finally:
        for s in streams:
            if s.transport is not None:
                s.transport.abort()
        await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="300 jobs, 5 s window")
    ap.add_argument("--jobs", type=int, default=None, help="waiting SSE jobs (default 1000, quick 300)")
    ap.add_argument("--window", type=float, default=None, help="measurement window, s (default 10, quick 5)")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--profile", action="store_true", help="py-spy the gateway during the window ($PYSPY or PATH)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    m = args.jobs or (300 if args.quick else 1000)
    window = args.window or (5.0 if args.quick else 10.0)
    bl.install_sigterm_exit()
    nofile = bl.raise_nofile()
    machine = bl.print_machine()
    print(f"# {m} SSE jobs (1 running, {m - 1} queued) behind a hanging node, heartbeat_sec 1, "
          f"window {window:g} s, RLIMIT_NOFILE {nofile}")
    proxy_cpu = None if args.no_pin else 0
    load_cpu = None if args.no_pin else 1
    with bl.workdir("sse") as wd, bl.Procs(wd) as procs:
        node_port, gw_port = bl.free_port(), bl.free_port()
        bl.start_fakegpu(procs, node_port, "node", cpu=load_cpu)
        bl.http_json(f"http://127.0.0.1:{node_port}/_fake/control", "POST", {"hang": True})
        routes = {"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 1, "max_queue_depth": m + 100,
                          "queue_timeout_sec": 3600, "request_timeout_sec": 3600}}
        cfg = bl.gateway_config(gw_port, {"gpu": f"http://127.0.0.1:{node_port}"}, routes, heartbeat_sec=1)
        gw, _ = bl.start_gateway(procs, cfg, cpu=proxy_cpu)
        if load_cpu is not None:
            with contextlib.suppress(OSError):
                import os

                os.sched_setaffinity(0, {load_cpu})
        raw = wd / "pyspy.raw"
        if args.profile and bl.find_pyspy() is None:
            print("(--profile: py-spy not found; pip install py-spy and/or set PYSPY)")
        res = run(measure(gw.pid, gw_port, m, window, args.settle,
                          raw if args.profile and bl.find_pyspy() else None))
        prof = bl.summarize_pyspy(raw) if raw.exists() else None
        st = bl.http_json(f"http://127.0.0.1:{gw_port}/admin/state", headers=bl.ADMIN_HDR)
        res["state_after"] = {"queue_depth": st["routes"]["gen"]["queue_depth"],
                              "inflight": st["routes"]["gen"]["inflight"]}
    j = res["jitter_ms"]
    print(f"\n## {m} waiting SSE jobs, heartbeat_sec 1 (window {window:g} s)")
    table = bl.print_table(
        ["jobs", "streams queued", "gateway CPU % of a core", "heartbeats/s", "streams w/o heartbeat",
         "jitter p50 ms", "jitter p99 ms", "jitter max ms", "RSS idle MB", "RSS window start MB",
         "RSS growth KB/job/min", "RSS growth B/logged event"],
        [[m, res["queued_seen"], res["gateway_cpu_pct"], res["heartbeats_per_sec"], res["streams_without_heartbeat"],
          j["p50"], j["p99"], j["max"], res["rss_idle_mb"], res["rss_window_start_mb"],
          res["rss_growth_kb_per_job_per_min"], res["rss_growth_bytes_per_logged_event"]]], nd=1)
    if prof:
        print(f"\n## Profile of the gateway during the window ({prof['samples']} GIL-holding samples)")
        bl.print_table(["top self frames", "%"], prof["self"], nd=1)
        print()
        bl.print_table(["kilolined frames (inclusive)", "%"], prof["kiloline_inclusive"], nd=1)
    bl.write_json(args.json, {"machine": machine, "result": res, "table": table, "profile": prof})
    return 0


def run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
