#!/usr/bin/env python3
"""A large response (default 1 GiB, --quick 256 MiB) from the node's GET /blob: MB/s direct,
through the gateway and through nginx (proxy_buffering off), and the gateway's RSS peak.

The client is curl (-o /dev/null) on core 1; the proxy under test has core 0. The gateway's RSS is
sampled every 20 ms during its transfer (and VmHWM read before and after): a proxy that streams
must stay flat whatever the size.

    .venv/bin/python scripts/bench_stream.py [--quick] [--mb 1024] [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import benchlib as bl


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, bl.rss_kb(self.pid))
            except (OSError, KeyError):
                return
            self._halt.wait(self.every)

    def stop(self) -> int:
        self._halt.set()
        self.join(timeout=2)
        return self.peak


def curl(url: str, cpu: int | None, timeout: float) -> dict[str, Any]:
    assert url.startswith("http://127.0.0.1:"), url
    cmd = bl.pinned(["curl", "-sS", "-o", "/dev/null", "-H", f"Authorization: Bearer {bl.API_KEY}",
                     "-w", "%{http_code} %{size_download} %{time_total}", "--max-time", str(int(timeout)), url], cpu)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10, check=False)
    code, size, secs = out.stdout.split()
    return {"status": int(code), "bytes": int(size), "sec": float(secs),
            "mb_s": int(size) / float(secs) / 1e6 if float(secs) > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB")
    ap.add_argument("--mb", type=int, default=None, help="MiB to stream (default 1024, quick 256)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if shutil.which("curl") is None:
        print("curl is needed (apt-get install curl)", file=sys.stderr)
        return 2
    mib = args.mb or (256 if args.quick else 1024)
    size = mib * 1024 * 1024
    bl.install_sigterm_exit()
    machine = bl.print_machine()
    proxy_cpu = None if args.no_pin else 0
    load_cpu = None if args.no_pin else 1
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": [], "nginx": []}
    with bl.workdir("stream") as wd, bl.Procs(wd) as procs:
        node_port, gw_port, ngx_port = bl.free_port(), bl.free_port(), bl.free_port()
        bl.start_fakegpu(procs, node_port, "node", cpu=load_cpu)
        cfg = bl.gateway_config(gw_port, {"gpu": f"http://127.0.0.1:{node_port}"})
        gw, _ = bl.start_gateway(procs, cfg, cpu=proxy_cpu)
        ngx = bl.start_nginx(procs, ngx_port, node_port, cpu=proxy_cpu, buffering=False)
        urls = {"direct": f"http://127.0.0.1:{node_port}/blob?bytes={size}",
                "gateway": f"http://127.0.0.1:{gw_port}/gen/blob?bytes={size}",
                "nginx": f"http://127.0.0.1:{ngx_port}/blob?bytes={size}"}
        pids = {"gateway": gw.pid, "nginx": ngx.pid}
        for t in urls:  # warm-up: small transfers
            curl(urls[t].replace(f"bytes={size}", "bytes=1048576"), load_cpu, 30)
        idle = {t: bl.rss_kb(p) for t, p in pids.items()}
        timeout = max(120.0, mib / 5)
        print(f"# {mib} MiB per transfer, {args.rounds} round(s)")
        for rnd in range(args.rounds):
            for t in ("direct", "gateway", "nginx"):
                sampler = RssSampler(pids[t]) if t in pids else None
                hwm0 = bl.proc_status(pids[t])["VmHWM"] if t in pids else None
                cpu0 = bl.cpu_seconds(pids[t]) if t in pids else None
                if sampler:
                    sampler.start()
                r = curl(urls[t], load_cpu, timeout)
                if sampler is not None:
                    r["rss_peak_kb"] = sampler.stop()
                    r["hwm_before_kb"], r["hwm_after_kb"] = hwm0, bl.proc_status(pids[t])["VmHWM"]
                    r["proxy_cpu_sec_per_gb"] = (bl.cpu_seconds(pids[t]) - cpu0) / (r["bytes"] / 1e9 or 1)
                runs[t].append(r)
                print(f"  round {rnd + 1} {t:<8} {r['status']} {r['bytes'] / 2**20:8.0f} MiB in {r['sec']:6.2f} s"
                      f" = {r['mb_s']:7.1f} MB/s" + (f", RSS peak {r['rss_peak_kb'] / 1024:.1f} MB" if sampler else ""),
                      flush=True)
                time.sleep(0.5)

    def med(t: str, k: str) -> Any:
        vals = [r[k] for r in runs[t] if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    print(f"\n## Streaming {mib} MiB from /blob")
    rows = []
    for t in ("direct", "gateway", "nginx"):
        ok = all(r["status"] == 200 and r["bytes"] == size for r in runs[t])
        peak = max((r.get("rss_peak_kb") or 0) for r in runs[t]) if t != "direct" else None
        rows.append([t, "yes" if ok else "NO", med(t, "mb_s"), (med(t, "mb_s") or 0) / (med("direct", "mb_s") or 1),
                     idle.get(t, 0) / 1024 if t != "direct" else None, peak / 1024 if peak else None,
                     (peak - idle[t]) / 1024 if peak else None, med(t, "proxy_cpu_sec_per_gb")])
    table = bl.print_table(["target", "complete", "MB/s", "÷ direct", "RSS idle MB", "RSS peak MB",
                            "peak − idle MB", "proxy CPU s/GB"], rows, nd=1)
    g, n = med("gateway", "mb_s"), med("nginx", "mb_s")
    if g and n:
        print(f"\n  gateway/nginx throughput: {g / n:.2f}; gateway RSS peak − idle: "
              f"{rows[1][6]:.1f} MB for {mib} MiB (flat memory = a few MB whatever the size)")
    bl.write_json(args.json, {"machine": machine, "mib": mib, "runs": runs, "idle_rss_kb": idle, "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
