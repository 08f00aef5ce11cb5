#!/usr/bin/env python3
"""Added latency of the gateway vs direct, nginx and HAProxy, on a zero-delay node.

One zero-delay node — by default nginx `return 200` (written in C, so the proxy under test is the
bottleneck), or with --upstream fakegpu a `kilolined fakegpu` (POST /generate {"steps": 0}) — is
measured four ways in the same run, interleaved per concurrency so that noise on a shared box hits
every target alike:

    direct   wrk → node
    gateway  wrk → kilolined (route max_concurrency 512: never queues) → node
    nginx    wrk → nginx (1 worker, upstream keepalive pool) → node
    haproxy  wrk → haproxy (1 thread, maxconn high, http-reuse always) → node

wrk (with a Lua script for the POST and the percentiles) runs on core 1 with the node; the proxy
under test has core 0 to itself. Reported: p50/p95/p99, requests/s, the proxy's CPU time per
request, and the ratios gateway/direct and gateway/nginx.

    .venv/bin/python scripts/bench_overhead.py [--quick] [--seconds 8] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import benchlib as bl

TARGETS = ("direct", "gateway", "nginx", "haproxy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s per point, 1 round")
    ap.add_argument("--seconds", type=float, default=None, help="wrk duration per point (default 8, quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="repeat the whole grid; medians are reported "
                                                             "(default 2, quick 1)")
    ap.add_argument("--conc", default="1,16,64,256", help="comma-separated wrk connection counts")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    ap.add_argument("--profile", action="store_true", help="after the grid, py-spy the gateway under wrk c=16 "
                                                          "(py-spy from $PYSPY or PATH) and print what dominates")
    ap.add_argument("--upstream", choices=("nginx", "fakegpu"), default="nginx",
                    help="the node: nginx `return 200` (C, zero delay: the proxy is what is measured; default) "
                         "or the Python fake GPU")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    rounds = args.rounds or (1 if args.quick else 2)
    concs = [int(c) for c in args.conc.split(",")]
    targets = [t for t in args.targets.split(",") if t]
    bl.install_sigterm_exit()
    bl.raise_nofile()
    machine = bl.print_machine()
    proxy_cpu = None if args.no_pin else 0
    load_cpu = None if args.no_pin else 1

    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with bl.workdir("overhead") as wd, bl.Procs(wd) as procs:
        node_port, gw_port, ngx_port, hap_port = (bl.free_port() for _ in range(4))
        if args.upstream == "nginx":
            bl.start_nginx_origin(procs, node_port, cpu=load_cpu)
        else:
            bl.start_fakegpu(procs, node_port, "node", cpu=load_cpu)
        pids: dict[str, int | None] = {"direct": None}
        urls = {"direct": f"http://127.0.0.1:{node_port}/generate"}
        if "gateway" in targets:
            cfg = bl.gateway_config(gw_port, {"gpu": f"http://127.0.0.1:{node_port}"})
            gw, _ = bl.start_gateway(procs, cfg, cpu=proxy_cpu)
            pids["gateway"] = gw.pid
            urls["gateway"] = f"http://127.0.0.1:{gw_port}/gen/generate"
        if "nginx" in targets:
            pids["nginx"] = bl.start_nginx(procs, ngx_port, node_port, cpu=proxy_cpu).pid
            urls["nginx"] = f"http://127.0.0.1:{ngx_port}/generate"
        if "haproxy" in targets:
            pids["haproxy"] = bl.start_haproxy(procs, hap_port, node_port, cpu=proxy_cpu).pid
            urls["haproxy"] = f"http://127.0.0.1:{hap_port}/generate"
        script = bl.wrk_script(wd)
        # Warm-up: fill keep-alive pools, JIT the interpreter's caches, let the node settle.
        for t in targets:
            bl.run_wrk(urls[t], script, 16, 2, cpu=load_cpu)
        print(f"# {len(targets)} targets × {len(concs)} concurrencies × {rounds} rounds × {seconds:g}s")
        for rnd in range(rounds):
            for c in concs:
                # Rotate the order each round so no target always runs first (or last) in a slot.
                order = targets[rnd % len(targets):] + targets[: rnd % len(targets)]
                for t in order:
                    pid = pids.get(t)
                    cpu0 = bl.cpu_seconds(pid) if pid else None
                    r = bl.run_wrk(urls[t], script, c, seconds, threads=1 if c < 64 else 2, cpu=load_cpu)
                    if pid and cpu0 is not None:
                        r["proxy_cpu_us_per_req"] = (bl.cpu_seconds(pid) - cpu0) / max(1, r["requests"]) * 1e6
                    results.setdefault((t, c), []).append(r)
                    print(f"  round {rnd + 1} c={c:<4} {t:<8} p50 {r['p50_us'] / 1000:7.3f} ms  "
                          f"p99 {r['p99_us'] / 1000:8.3f} ms  {r['rps']:8.0f} req/s  errors {r['errors']}",
                          flush=True)
                    time.sleep(0.3)
        rss = {t: bl.rss_kb(pid) for t, pid in pids.items() if pid}
        gw_log = (wd / "gateway.log").read_text(errors="replace") if "gateway" in targets else ""
        # The node never fails here; wrk closing its connections at the end of each run does.
        spurious = sum("connection lost mid-response" in ln for ln in gw_log.splitlines())
        profile = run_profile(wd, urls, pids, script, load_cpu) if args.profile else None

    def med(t: str, c: int, k: str) -> float | None:
        vals = [r[k] for r in results.get((t, c), []) if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    print("\n## Latency and throughput (medians over rounds; ms)")
    rows = []
    for c in concs:
        for t in targets:
            cpu = med(t, c, "proxy_cpu_us_per_req")
            rows.append([c, t, med(t, c, "p50_us") / 1000, med(t, c, "p95_us") / 1000, med(t, c, "p99_us") / 1000,
                         round(med(t, c, "rps") or 0), cpu, int(sum(r["errors"] for r in results[(t, c)]))])
    table1 = bl.print_table(["conc", "target", "p50 ms", "p95 ms", "p99 ms", "req/s", "proxy CPU µs/req",
                             "errors"], rows, nd=3)

    print("\n## Added latency vs direct (ms) and ratios")
    rows2 = []
    summary: dict[str, Any] = {}
    for c in concs:
        d = {k: med("direct", c, k + "_us") for k in ("p50", "p95", "p99")}
        for t in targets:
            if t == "direct" or None in d.values():
                continue  # nothing to compare against without the direct run
            added = {k: (med(t, c, k + "_us") - d[k]) / 1000 for k in d}
            rps_ratio = (med(t, c, "rps") or 0) / (med("direct", c, "rps") or 1)
            ngx = med("nginx", c, "p50_us") if "nginx" in targets else None
            rows2.append([c, t, added["p50"], added["p95"], added["p99"], rps_ratio,
                          (med(t, c, "p50_us") / ngx) if ngx else None])
            summary[f"{t}@{c}"] = {"added_ms": added, "rps_vs_direct": rps_ratio}
    table2 = bl.print_table(["conc", "target", "+p50 ms", "+p95 ms", "+p99 ms", "req/s ÷ direct",
                             "p50 ÷ nginx p50"], rows2, nd=3)
    if "gateway" in targets:
        g1 = summary.get("gateway@1", {}).get("added_ms", {}).get("p50")
        g64 = med("gateway", 64, "p99_us")
        print("\n## Targets")
        if g1 is not None:
            print(f"  added p50 at concurrency 1: {g1:.3f} ms (target ≤ 0.5 ms) -> {'MET' if g1 <= 0.5 else 'MISSED'}")
        a64 = summary.get("gateway@64", {}).get("added_ms", {}).get("p99")
        if a64 is not None:
            # The issue's §1 measures *added* latency; the absolute p99 is printed beside it with the
            # same run's references, because on a 2-core box the node and wrk share a core and set
            # a floor that every proxy pays (direct's own p99 at c=64 is 6–11 ms here).
            print(f"  added p99 at concurrency 64: {a64:.3f} ms (target ≤ 10 ms) -> {'MET' if a64 <= 10 else 'MISSED'}")
        if g64 is not None:
            refs = ", ".join(f"{t} {v / 1000:.3f} ms" for t in ("direct", "nginx", "haproxy")
                             if t in targets and (v := med(t, 64, "p99_us")) is not None)
            print(f"  absolute p99 at concurrency 64: gateway {g64 / 1000:.3f} ms"
                  + (f" (same run: {refs})" if refs else "")
                  + f" -> {'≤ 10 ms' if g64 / 1000 <= 10 else 'over 10 ms'}")
        print(f"  RSS after the run (kB): {rss}")
        print(f"  gateway log: {spurious} × '✗ [gpu] connection lost mid-response' (node failures recorded when "
              f"wrk closed its connections; the node never failed)")
    if profile:
        print_profile(profile)
    bl.write_json(args.json, {
        "machine": machine, "seconds": seconds, "rounds": rounds, "upstream": args.upstream,
        "runs": {f"{t}@{c}": v for (t, c), v in results.items()}, "summary": summary, "rss_kb": rss,
        "spurious_node_failures": spurious,
        "tables": [table1, table2], "profile": profile,
    })
    return 0


def run_profile(wd: Any, urls: dict[str, str], pids: dict[str, int | None], script: Any,
                load_cpu: int | None) -> dict[str, Any] | None:
    """py-spy the gateway for 15 s under wrk c=16 (only samples that hold the GIL)."""
    pid = pids.get("gateway")
    if not pid:
        return None
    raw = wd / "pyspy.raw"
    spy = bl.pyspy_record(pid, 15, raw)
    if spy is None:
        print("\n(--profile: py-spy not found; `pip install py-spy` and/or set PYSPY=/path/to/py-spy)")
        return None
    try:
        time.sleep(0.5)
        cpu0 = bl.cpu_seconds(pid)
        r = bl.run_wrk(urls["gateway"], script, 16, 14, cpu=load_cpu)
        cpu_per_req = (bl.cpu_seconds(pid) - cpu0) / max(1, r["requests"]) * 1e6
        spy.wait(timeout=60)
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait()
    if not raw.exists():
        print("\n(--profile: py-spy wrote nothing; it needs ptrace rights on the gateway)")
        return None
    prof = bl.summarize_pyspy(raw)
    prof["wrk"] = r
    prof["cpu_us_per_req"] = cpu_per_req
    return prof


def print_profile(prof: dict[str, Any]) -> None:
    r = prof["wrk"]
    print(f"\n## Profile: gateway under wrk c=16, {r['rps']:.0f} req/s, {prof['cpu_us_per_req']:.0f} µs CPU per "
          f"request, {prof['samples']} GIL-holding samples (py-spy --gil)")
    bl.print_table(["where the gateway's Python time goes", "% of samples"], prof["groups"], nd=1)
    print()
    bl.print_table(["top self frames", "%"], prof["self"], nd=1)
    print()
    bl.print_table(["kilolined frames (inclusive)", "%"], prof["kiloline_inclusive"], nd=1)


if __name__ == "__main__":
    sys.exit(main())
