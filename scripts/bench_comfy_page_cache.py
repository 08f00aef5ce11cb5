"""ComfyUI's real web UI straight from a node against through a gateway, where the browser's
cache and the network matter: the gateway holds the frontend's content-hashed files, answers them
immutable and gzipped (docs/API.md "ComfyUI over several GPUs"); ComfyUI sends them ``no-store``
and uncompressed.

Three kinds of load, each in a new tab of headless Chromium, time to app-ready as
scripts/check_comfy_web_ui.py measures it (the page loaded, the app's graph up, the splash gone):
  - repeat visit: the browser's cache on, after one warm load of each, over loopback;
  - the same over a home link, the network emulated by DevTools
    (``Network.emulateNetworkConditions``: ``--down`` Mbit/s, ``--up`` Mbit/s, ``--latency`` ms);
  - first visit over that link: the cache off.
Straight and through the gateway interleaved load by load; per kind the median of ``--loads``
loads, the bytes on the wire per load (Resource Timing ``transferSize``, the page's own entry
included) and, with ``--gateway-pid``, the gateway's CPU per load.

    python scripts/bench_comfy_page_cache.py http://127.0.0.1:18590 /comfy "$KEY" \\
        --node http://127.0.0.1:18488 --gateway-pid "$(cat gw.pid)" --loads 5

Needs /usr/bin/chromium, /usr/bin/chromedriver and selenium.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from check_comfy_web_ui import READY, browser, cpu_ms, fresh_tab, wait

# The page asks for ~250 files: Resource Timing's default buffer (250 entries) would drop some.
BUFFER = "performance.setResourceTimingBufferSize(5000);"
WIRE = ("return [performance.getEntriesByType('navigation')[0], ...performance.getEntriesByType('resource')]"
        ".reduce((n, e) => n + (e.transferSize || 0), 0);")
HELD = "return performance.getEntriesByType('resource').filter(e => e.transferSize === 0).length;"


def load(driver: Any, url: str, key: str | None, cache_off: bool, link: dict[str, Any] | None,
         pid: int | None) -> tuple[float, int, int, float]:
    """(seconds to app-ready, bytes on the wire, files from the browser's cache, gateway CPU ms)."""
    fresh_tab(driver, key, cache_off, link, BUFFER)
    before = cpu_ms(pid)
    started = time.monotonic()
    driver.get(url)
    if not wait(driver, READY, 120, every=0.02):
        raise RuntimeError(f"{url}: the app was not ready within 120 s")
    took = time.monotonic() - started
    time.sleep(0.5)  # the requests the app makes once ready, counted in the bytes and the CPU
    return took, int(driver.execute_script(WIRE)), int(driver.execute_script(HELD)), cpu_ms(pid) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gateway")
    ap.add_argument("path")
    ap.add_argument("key")
    ap.add_argument("--node", required=True, help="the node the straight loads go to")
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--gateway-pid", type=int)
    ap.add_argument("--down", type=float, default=50.0, help="emulated download, Mbit/s")
    ap.add_argument("--up", type=float, default=20.0, help="emulated upload, Mbit/s")
    ap.add_argument("--latency", type=float, default=20.0, help="emulated round trip added, ms")
    args = ap.parse_args()
    link = {"offline": False, "latency": args.latency, "downloadThroughput": args.down * 1e6 / 8,
            "uploadThroughput": args.up * 1e6 / 8}
    ways = {"straight": (args.node.rstrip("/") + "/", None), "gateway": (args.gateway + args.path + "/", args.key)}
    home = f"{args.down:g}/{args.up:g} Mbit/s {args.latency:g} ms"
    kinds = {"repeat visit, loopback (cache on)": (False, None), f"repeat visit, {home} (cache on)": (False, link),
             f"first visit, {home} (cache off)": (True, link)}
    driver = browser(args.key)
    try:
        for way, (url, key) in ways.items():  # the warm load: the browser's cache, the gateway's
            warm = load(driver, url, key, False, None, args.gateway_pid if way == "gateway" else None)
            if way == "gateway" and args.gateway_pid:
                print(f"the warm load through the gateway: {warm[3]:.0f} ms of its CPU (the files it did not "
                      "hold yet fetched, hashed and gzipped once)")
        got: dict[tuple[str, str], list[tuple[float, int, int, float]]] = {}
        for kind, (cache_off, net) in kinds.items():
            for _ in range(args.loads):
                for way, (url, key) in ways.items():
                    got.setdefault((kind, way), []).append(
                        load(driver, url, key, cache_off, net, args.gateway_pid if way == "gateway" else None))
    finally:
        driver.quit()
    print(f"{'load':<48} {'way':<9} {'ready s (median)':>16} {'all':>30} {'wire MB':>8} {'cached files':>12} "
          f"{'gw CPU ms':>9}")
    for (kind, way), runs in got.items():
        secs = [r[0] for r in runs]
        print(f"{kind:<48} {way:<9} {statistics.median(secs):>16.2f} {' '.join(f'{s:.2f}' for s in secs):>30} "
              f"{statistics.median(r[1] for r in runs) / 1e6:>8.2f} {statistics.median(r[2] for r in runs):>12.0f} "
              f"{statistics.median(r[3] for r in runs) if way == 'gateway' and args.gateway_pid else 0:>9.0f}")


if __name__ == "__main__":
    main()
