"""ComfyUI's real web UI, through a gateway route, over real ComfyUI servers, in headless Chromium.

Loads ``{gateway}{path}`` (without its slash: the redirect is part of the check) with the key sent
as a header, waits for the app, queues ``--prompts`` (3: more than two slots) prompts of the
weight-free ``KLSlowProgress`` node (scripts/real_backends_setup.sh installs it), timing the app's
queue call for each, and prints, per prompt, the websocket events the page
received through the gateway's one socket, the output images it shows, its console errors, and
(with ``--node``) which node ran each prompt, from the nodes' own ``/history``.

The prompts are img2img: the page uploads an image first, as the LoadImage widget does, so
each node gets the input from the gateway.

With ``--page-loads N`` it then measures the page bar, in the same run: time to app-ready (the
page loaded, the app's graph up, the splash gone; each load a new tab with the cache off, as a
user opening the page: every file is fetched),
N loads of each kind, the kinds interleaved load by load:
  - nothing rendering: the page straight from the first ``--node`` (the peer), and through the
    gateway;
  - while every slot of the route renders a slow prompt of the key and as many again wait in its
    queue (``--slots``: the route's slots over all its nodes): the same two, and with
    ``--other-key`` the page through the gateway as a key that hears none of those renders;
and prints the medians, each as a multiple of the peer's, the median of each load's slowest
request (Resource Timing: what the page waited for on the network at most), and the load
average (the CPU is shared).
Then, idle and while every slot renders, every file that page load fetched, without the browser
(6 at a time): straight from the node against through the gateway, and with ``--gateway-pid``
the gateway's CPU time per file; and one at a time, each file straight then through the
gateway: what the gateway adds to one.

With ``--kill-pid PID`` (the first node's process) it ends by killing that node and loading the
page again at once, before a health check can tell the gateway.

    python scripts/check_comfy_web_ui.py http://127.0.0.1:8290 /comfy "$ALICE_KEY" \\
        --node http://127.0.0.1:18188 --node http://127.0.0.1:18189 --page-loads 5 --slots 2 \\
        --other-key "$BOB_KEY" --gateway-pid "$GATEWAY_PID"

Needs /usr/bin/chromium, /usr/bin/chromedriver and selenium.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

# Every frame the page's own socket receives: (type, prompt id), recorded before the app runs.
RECORD = """
window.__ws = []; window.__outputs = {};
const WS = window.WebSocket;
window.WebSocket = class extends WS { constructor(u, p) { super(u, p); window.__wsurl = String(u);
  this.addEventListener('message', (ev) => {
    if (typeof ev.data !== 'string') { window.__ws.push(['binary', null]); return; }
    const m = JSON.parse(ev.data); window.__ws.push([m.type, (m.data && m.data.prompt_id) || null]);
    if (m.type === 'executed' && m.data.output && m.data.output.images)
      window.__outputs[m.data.prompt_id] = m.data.output.images; }); } };
"""
READY = "return !!(window.app && window.app.graph && !document.querySelector('#splash-loader'))"
# The page uploads an image as the LoadImage widget does (POST {api}/upload/image), then reads it
# back as the widget's preview does (/view?type=input): [name, the preview's status].
UPLOAD = """const cb = arguments[arguments.length - 1];
const c = document.createElement('canvas'); c.width = c.height = 16;
const g = c.getContext('2d'); g.fillStyle = '#3a7'; g.fillRect(0, 0, 16, 16);
g.fillStyle = '#c21'; g.fillRect(4, 4, 8, 8);
c.toBlob(async (blob) => {
  const form = new FormData(); form.append('image', blob, 'kl-page.png'); form.append('overwrite', 'true');
  const up = await (await fetch('api/upload/image', { method: 'POST', body: form })).json();
  const v = await fetch('api/view?filename=' + encodeURIComponent(up.name) + '&type=input&subfolder=');
  cb([up.name, v.status]); }, 'image/png');"""
VIEW_OUTPUTS = """const cb = arguments[arguments.length - 1];
Promise.all(Object.entries(window.__outputs).map(async ([pid, imgs]) => {
  const i = imgs[0], r = await fetch('api/view?' + new URLSearchParams({filename: i.filename, subfolder: i.subfolder,
                                                                          type: i.type}));
  const img = await createImageBitmap(await r.blob());
  return [pid.slice(0, 8), i.filename, r.status, img.width + 'x' + img.height]; })).then(cb, (e) => cb(String(e)));"""
# Loads the graph into the app and presses its Run: the ms the app's queue call took (ComfyUI
# answers at once; a gateway that held the POST until a slot is free would show here).
QUEUE = ("const cb = arguments[arguments.length - 1];"
         "window.app.loadApiJson(arguments[0], 'kl.json');"
         "setTimeout(() => { const t = performance.now();"
         " window.app.queuePrompt(0, 1).then(() => cb(Math.round(performance.now() - t)), (e) => cb(String(e))); },"
         " 500);")


def wait(driver: Any, script: str, timeout: float, every: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if driver.execute_script(script):
            return True
        time.sleep(every)
    return False


def browser(key: str) -> Any:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    driver.set_script_timeout(60)
    tab_setup(driver, key)
    return driver


def tab_setup(driver: Any, key: str | None, cache_off: bool = False, link: dict[str, Any] | None = None,
              script: str = RECORD) -> None:
    """The current tab's DevTools settings (they are per tab): the key as a header, ``script`` (the
    socket recorder) before the page's own, the cache off or on, and an emulated network
    (``Network.emulateNetworkConditions``; None: loopback as it is)."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": cache_off})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                           {"headers": {"Authorization": f"Bearer {key}"} if key else {}})
    if link is not None:
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", link)
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": script})


def fresh_tab(driver: Any, key: str | None, cache_off: bool = True, link: dict[str, Any] | None = None,
              script: str = RECORD) -> None:
    """Replace the tab with a new one (by default the cache off): a page opened as a user opens it.
    Reloading one tab over and over measures the tab instead — its renderer grows with every load
    of this 13.5 MB app, ~1.4 s to ~1.95 s over 30 loads here, so whichever kind came later lost."""
    old = driver.current_window_handle
    driver.switch_to.new_window("tab")
    fresh = driver.current_window_handle
    driver.switch_to.window(old)
    driver.close()
    driver.switch_to.window(fresh)
    tab_setup(driver, key, cache_off, link, script)


def slow_prompt(steps: int, step_ms: int, seed: int, image: str | None = None) -> dict[str, Any]:
    """KLSlowProgress → SaveImage; with ``image``, img2img: LoadImage of that upload first."""
    g: dict[str, Any] = {
        "1": {"class_type": "KLSlowProgress", "inputs": {"steps": steps, "step_ms": step_ms, "seed": seed}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "kl"}}}
    if image is not None:
        g["3"] = {"class_type": "LoadImage", "inputs": {"image": image}}
        g["1"]["inputs"]["image"] = ["3", 0]
    return g


def call(url: str, key: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         method: str | None = None) -> Any:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                          **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def check_prompts(driver: Any, gateway: str, path: str, steps: int, step_ms: int, nodes: list[str],
                  prompts: int) -> bool:
    started = time.monotonic()
    driver.get(gateway + path)
    ready = wait(driver, READY, 90)
    print(f"landed on {driver.current_url}; app ready: {ready} after {time.monotonic() - started:.1f}s; "
          f"socket {driver.execute_script('return window.__wsurl')}")
    name, status = driver.execute_async_script(UPLOAD)
    print(f"uploaded from the page: {name}; its preview (/view?type=input): {status}")
    for seed in range(1, prompts + 1):
        graph = slow_prompt(steps, step_ms, int(time.time()) * 10 + seed, name)
        took = driver.execute_async_script(QUEUE, graph)
        print(f"queued img2img {seed} of {prompts}: the app's queue call took {took} ms")
    wait(driver, f"return window.__ws.filter(f => f[0] == 'execution_success').length >= {prompts}",
         steps * step_ms / 1000 * prompts + 60)
    by_prompt: dict[str | None, dict[str, int]] = {}
    for kind, pid in driver.execute_script("return window.__ws"):
        counts = by_prompt.setdefault(pid, {})
        counts[kind] = counts.get(kind, 0) + 1
    ran = {pid: url for url in nodes for pid in call(url + "/history", "")}
    for pid, counts in by_prompt.items():
        print(pid or "(no prompt id)", f"ran on {ran.get(pid, '?')}" if pid and nodes else "", counts)
    wait(driver, "return [...document.querySelectorAll('img')].some(i => i.src.includes('/view') && i.naturalWidth)",
         10)
    images = driver.execute_script("return [...document.querySelectorAll('img')]"
                                   ".filter(i => i.src.includes('/view')).map(i => [i.src, i.naturalWidth])")
    print("images shown:", images)
    # each prompt's image as the page would load it, under the name its `executed` event gave
    print("each prompt's image from the page:", driver.execute_async_script(VIEW_OUTPUTS))
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    print(f"console errors: {len(errors)}")
    for message in errors:
        print("  ", message[:200])
    return ready and sum("execution_success" in c for c in by_prompt.values()) >= prompts


SLOWEST = "return Math.max(0, ...performance.getEntriesByType('resource').map(e => e.duration));"


def page_ready(driver: Any, url: str, key: str | None, slowest: list[float] | None = None) -> float:
    """Seconds from navigating to ``url`` (as ``key``) in a new tab until the app is ready (cache
    off: every file fetched); ``slowest`` gets the ms of the load's slowest request (Resource Timing)."""
    fresh_tab(driver, key)
    started = time.monotonic()
    driver.get(url)
    if not wait(driver, READY, 60, every=0.02):
        raise RuntimeError(f"{url}: the app was not ready within 60 s")
    took = time.monotonic() - started
    if slowest is not None:
        slowest.append(float(driver.execute_script(SLOWEST)))
    return took


def page_files(driver: Any) -> list[str]:
    """Every URL the page just loaded fetched (the Resource Timing entries, XHR and fetch included)."""
    return [u for u in driver.execute_script(
        "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]")
        if u.startswith("http") and "/ws?" not in u]


def fetch_all(urls: list[str], headers: dict[str, str]) -> float:
    """Seconds to fetch every URL over 6 connections at a time, as a browser does per host."""
    def one(url: str) -> int:
        req = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return len(r.read())
        except urllib.error.HTTPError as e:  # the node's own 404s (user.css) are part of the page
            return len(e.read())

    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, urls))
    return time.monotonic() - started


def cpu_ms(pid: int | None) -> float:
    """CPU time (user + system) the process has used, in ms (0 without a pid)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def bench_files(urls: list[str], gateway: str, path: str, key: str, node: str, n: int,
                pid: int | None) -> dict[str, float]:
    """The page's files without the browser: through the gateway and straight from the node
    (root-absolute ones found under the route by the page's Referer, as the browser sends it);
    with the gateway's pid, its CPU per file (the figure the shared box's load moves least)."""
    route = gateway + path + "/"
    direct = [node + u[len(gateway + path):] if u.startswith(gateway + path) else node + u[len(gateway):]
              for u in urls]
    via = {"Authorization": f"Bearer {key}", "Referer": route}
    took: dict[str, list[float]] = {"direct": [], "gateway": []}
    cpu = 0.0
    for _ in range(n):
        took["direct"].append(fetch_all(direct, {}))
        before = cpu_ms(pid)
        took["gateway"].append(fetch_all(urls, via))
        cpu += cpu_ms(pid) - before
    # one at a time, each file straight then through the gateway: what the gateway adds to one
    added = sorted(fetch_all([g], via) - fetch_all([d], {}) for d, g in zip(direct, urls, strict=True))
    return {**{k: statistics.median(v) for k, v in took.items()}, "cpu_ms_a_file": cpu / (n * len(urls)),
            "added_p50": added[len(added) // 2], "added_p99": added[int(len(added) * 0.99)]}


def bench_page(driver: Any, gateway: str, path: str, key: str, other: str | None, node: str, n: int,
               slots: int, pid: int | None) -> None:
    """The page bar: time to app-ready, the page straight from a node against through the gateway,
    nothing rendering, then while every slot renders; the kinds interleaved load by load, so a
    change in the machine's load falls on all of them."""
    route = gateway + path + "/"
    page_ready(driver, route, key)  # the first load warms the gateway's and the node's own caches
    urls = page_files(driver)
    files = {"idle": bench_files(urls, gateway, path, key, node, n, pid)}
    kinds: dict[str, tuple[str, str | None]] = {"direct": (node + "/", None), "gateway": (route, key)}
    took: dict[str, list[float]] = {}
    slow: dict[str, list[float]] = {}  # per kind, each load's slowest request (ms)
    for _ in range(n):
        for kind, (url, who) in kinds.items():
            took.setdefault(f"{kind}, idle", []).append(
                page_ready(driver, url, who, slow.setdefault(f"{kind}, idle", [])))
    # Every slot rendering (sync prompts: answered once dispatched), as many again waiting in the
    # gateway's queue (async jobs: answered at once); long enough for the loads.
    seed = int(time.time()) * 100
    running = [call(gateway + path + "/prompt", key, {"prompt": slow_prompt(1200, 100, seed + i)})["prompt_id"]
               for i in range(slots)]
    waiting = [call(gateway + path + "/prompt", key, {"prompt": slow_prompt(1200, 100, seed + slots + i)},
                    {"X-KiloLine-Mode": "async"})["job_id"] for i in range(slots)]
    if other:
        kinds["gateway, another key"] = (route, other)  # a page that hears none of the renders
    try:
        time.sleep(1.0)
        for _ in range(n):
            for kind, (url, who) in kinds.items():
                name = f"{kind}, {slots} rendering + {slots} queued"
                took.setdefault(name, []).append(page_ready(driver, url, who, slow.setdefault(name, [])))
        files["busy"] = bench_files(urls, gateway, path, key, node, n, pid)
        load = os.getloadavg()
    finally:
        for job in waiting:
            call(gateway + "/v1/jobs/" + job, key, method="DELETE")
        for pid in running:
            call(gateway + path + "/interrupt", key, {"prompt_id": pid})
    med = {k: statistics.median(v) for k, v in took.items()}
    base = med["direct, idle"]
    print(f"page to app-ready (cache off), median of {n}; direct = {node}; "
          f"load average {' '.join(f'{x:.2f}' for x in load)}")
    for k, v in took.items():
        print(f"   {k:<45} {med[k]:5.2f}s  x{med[k] / base:.2f} of direct idle, slowest request "
              f"{statistics.median(slow[k]):4.0f} ms   ({' '.join(f'{x:.2f}' for x in v)})")
    print(f"the page's {len(urls)} files without the browser (6 at a time), median of {n}:")
    for state, m in files.items():
        print(f"   {state}: direct {m['direct'] * 1000:.0f} ms, through the gateway {m['gateway'] * 1000:.0f} ms "
              f"(+{(m['gateway'] - m['direct']) * 1000 / len(urls):.2f} ms a file); one at a time the gateway "
              f"adds p50 {m['added_p50'] * 1000:.2f} ms, p99 {m['added_p99'] * 1000:.2f} ms"
              + (f"; the gateway's CPU {m['cpu_ms_a_file']:.2f} ms a file" if pid else ""))


def page_after_kill(driver: Any, route: str, key: str, pid: int) -> bool:
    """The node serving the page killed, the page loaded again at once (no health check has told
    the gateway yet): does it load, and how soon?"""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        took = page_ready(driver, route, key)
    except RuntimeError as e:
        print(f"page after its node was killed: {e}")
        return False
    print(f"page after its node was killed: ready in {took:.2f}s, {time.monotonic() - killed:.1f}s after the kill")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gateway")
    ap.add_argument("path")
    ap.add_argument("key")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-ms", type=int, default=250)
    ap.add_argument("--prompts", type=int, default=3,
                    help="img2img prompts the page queues (more than the route's slots: some wait)")
    ap.add_argument("--node", action="append", default=[], help="a node's URL (the first is the page's peer)")
    ap.add_argument("--page-loads", type=int, default=0, help="measure the page bar with N loads each")
    ap.add_argument("--slots", type=int, default=2, help="the route's slots over all its nodes")
    ap.add_argument("--other-key", help="also load the page as this key while the first key's prompts render")
    ap.add_argument("--gateway-pid", type=int, help="the gateway's pid: its CPU per page file")
    ap.add_argument("--kill-pid", type=int,
                    help="last, kill this process (the node serving the page) and load the page again at once")
    args = ap.parse_args()
    driver = browser(args.key)
    try:
        ok = check_prompts(driver, args.gateway, args.path, args.steps, args.step_ms, args.node, args.prompts)
        if args.page_loads and args.node:
            bench_page(driver, args.gateway, args.path, args.key, args.other_key, args.node[0], args.page_loads,
                       args.slots, args.gateway_pid)
        if args.kill_pid:
            ok = page_after_kill(driver, args.gateway + args.path + "/", args.key, args.kill_pid) and ok
        return 0 if ok else 1
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())
