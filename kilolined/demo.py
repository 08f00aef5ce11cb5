"""``kilolined demo``: the traffic-smoothing demo, all on loopback, nothing but the package.

Two simulated 24 GB GPUs (10 GB per job: two fit, the third OOMs). The same burst of 10
concurrent requests goes first straight at one card, then through the gateway with
``max_concurrency: 2``; then a burst with the primary killed midway shows the failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import sys
import time
from dataclasses import dataclass

import aiohttp

from kilolined.config import parse_config
from kilolined.fakegpu import FakeGPU
from kilolined.server import Server

BURST = 10
STEPS, STEP_MS = 8, 100  # 0.8 s per image


class Style:
    def __init__(self, enabled: bool):
        self.on = enabled

    def _c(self, code: str, s: str) -> str:
        return f"\033[{code}m{s}\033[0m" if self.on else s

    def red(self, s: str) -> str:
        return self._c("31;1", s)

    def green(self, s: str) -> str:
        return self._c("32;1", s)

    def yellow(self, s: str) -> str:
        return self._c("33;1", s)

    def bold(self, s: str) -> str:
        return self._c("1", s)

    def dim(self, s: str) -> str:
        return self._c("2", s)


@dataclass
class Outcome:
    status: str  # "200", "500", "refused", …
    seconds: float
    wait_ms: int | None = None
    node: str | None = None


async def fire(session: aiohttp.ClientSession, url: str, headers: dict[str, str], i: int) -> Outcome:
    t0 = time.monotonic()
    try:
        async with session.post(url, json={"echo": i}, headers=headers) as r:
            await r.read()
            wait = r.headers.get("X-KiloLine-Queue-Wait-Ms")
            return Outcome(str(r.status), time.monotonic() - t0, int(wait) if wait else None,
                           r.headers.get("X-KiloLine-Node"))
    except aiohttp.ClientConnectorError:
        return Outcome("refused", time.monotonic() - t0)
    except (aiohttp.ClientError, TimeoutError):
        return Outcome("reset", time.monotonic() - t0)


def summary(results: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def bar(results: list[Outcome], st: Style) -> str:
    cells = []
    for r in results:
        cells.append(st.green("■") if r.status == "200" else st.red("✗"))
    return " ".join(cells)


def gateway_config(primary: str, standby: str, admin_key: str, key: str, port: int) -> str:
    return f"""
server: {{listen: "127.0.0.1:{port}", heartbeat_sec: 2, shutdown_grace_sec: 3, access_log: false}}
admin: {{key_sha256: "{hashlib.sha256(admin_key.encode()).hexdigest()}"}}
keys:
  demo: {{key_sha256: "{hashlib.sha256(key.encode()).hexdigest()}", routes: ["*"]}}
nodes:
  gpu-a: {{url: "{primary}", label: "RTX 4090 #A (spot)",
          health: {{path: /health, interval_sec: 0.25, timeout_sec: 0.5, fall: 1, rise: 2}},
          breaker: {{consecutive_failures: 2, open_sec: 2, slow_start_sec: 3}}}}
  gpu-b: {{url: "{standby}", label: "RTX 4090 #B (standby)",
          health: {{path: /health, interval_sec: 0.25, timeout_sec: 0.5, fall: 1, rise: 2}}}}
routes:
  images:
    path: /images
    nodes: [gpu-a]
    standby: [gpu-b]
    max_concurrency: 2
    max_queue_depth: 100
    queue_timeout_sec: 60
    expected_duration_sec: {STEPS * STEP_MS / 1000}
    retry_on_failover: 2
cost: {{gpu_hourly_usd: 0.30, serverless_per_sec_usd: 0.0011}}
"""


async def run_demo(once: bool, port: int = 8080, out: object = None) -> int:
    stream = out or sys.stdout
    st = Style(hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR"))

    def say(s: str = "") -> None:
        print(s, file=stream, flush=True)  # type: ignore[call-overload]

    gpu_a = FakeGPU("generic", vram_gb=24, job_vram_gb=10, steps=STEPS, step_ms=STEP_MS, crash_sec=2)
    gpu_b = FakeGPU("generic", vram_gb=24, job_vram_gb=10, steps=STEPS, step_ms=STEP_MS, crash_sec=2)
    await gpu_a.start()
    await gpu_b.start()
    admin_key = "kl_" + secrets.token_urlsafe(24)
    key = "kl_" + secrets.token_urlsafe(24)
    server: Server | None = None
    try:
        say(st.bold("KiloLine demo — 10 concurrent image requests against a 24 GB RTX 4090 (10 GB per job)"))
        say(st.dim(f"  simulated GPUs: gpu-a {gpu_a.url}, gpu-b {gpu_b.url} (standby)"))
        say()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            # 1. straight at the card
            say(st.bold("1) Without a gateway: all 10 hit the GPU at once"))
            direct = await asyncio.gather(*[fire(http, gpu_a.url + "/generate", {}, i) for i in range(BURST)])
            s = summary(direct)
            ok = s.get("200", 0)
            say(f"   {bar(direct, st)}")
            say(f"   {st.red('GPU crashed: CUDA out of memory')} — {ok} served, {BURST - ok} failed {s}; "
                f"oom_count={gpu_a.stats['oom_count']}, the card refused connections for "
                f"{gpu_a.crash_sec:g}s")
            await asyncio.sleep(gpu_a.crash_sec + 0.3)
            # 2. through the gateway
            cfg_text = gateway_config(gpu_a.url, gpu_b.url, admin_key, key, port)
            try:
                server = Server(parse_config(cfg_text, env={}), hashlib.sha256(cfg_text.encode()).hexdigest(), None)
                await server.start()
            except OSError:
                server = Server(parse_config(gateway_config(gpu_a.url, gpu_b.url, admin_key, key, 0), env={}),
                                "demo", None)
                await server.start()
            gw = f"http://127.0.0.1:{server.port}"
            hdr = {"Authorization": f"Bearer {key}"}
            await asyncio.sleep(0.8)  # first health checks
            gpu_a.reset()
            say()
            say(st.bold("2) Through KiloLine with max_concurrency: 2 — the same 10 at once"))
            t0 = time.monotonic()
            via = await asyncio.gather(*[fire(http, gw + "/images/generate", hdr, i) for i in range(BURST)])
            took = time.monotonic() - t0
            s = summary(via)
            waits = sorted(r.wait_ms or 0 for r in via)
            say(f"   {bar(via, st)}")
            verdict = st.green(f"all {s.get('200', 0)} served") if s.get("200") == BURST else st.red(f"{s}")
            say(f"   {verdict}; the GPU never ran more than {gpu_a.stats['max_concurrent']} at once, "
                f"oom_count={gpu_a.stats['oom_count']}; queue waits {waits[0]}–{waits[-1]} ms; "
                f"burst done in {took:.1f}s")
            # 3. failover
            say()
            say(st.bold("3) Spot interruption: the primary dies mid-burst"))
            burst = [asyncio.create_task(fire(http, gw + "/images/generate", hdr, i)) for i in range(BURST)]
            await asyncio.sleep(STEPS * STEP_MS / 1000 * 1.5)
            await gpu_a.kill()
            say(f"   {st.yellow('⚡ gpu-a killed')} with {sum(1 for t in burst if not t.done())} requests unfinished")
            fo = await asyncio.gather(*burst)
            s = summary(fo)
            by_node: dict[str, int] = {}
            for r in fo:
                if r.node:
                    by_node[r.node] = by_node.get(r.node, 0) + 1
            say(f"   {bar(fo, st)}")
            verdict = st.green(f"nothing lost: {s.get('200', 0)}/{BURST} served") if s.get("200") == BURST \
                else st.red(f"lost some: {s}")
            say(f"   {verdict}; served by {by_node}; "
                f"re-queued after the node died: {int(_failovers(server))}")
            await gpu_a.revive()
        say()
        if once:
            # The gateway stops as this returns: a dashboard URL or keys printed now would be dead.
            say(st.dim("--once: the gateway stops here; run `kilolined demo` to keep it up and "
                       "watch the same bursts on its dashboard."))
            return 0 if s.get("200") == BURST else 1
        say(st.bold("Dashboard: ") + f"{gw}/dashboard")
        say(st.bold("Admin key: ") + admin_key)
        say(st.bold("API key:   ") + key + st.dim(f"   (try: curl -H 'Authorization: Bearer {key}' "
                                                   f"-X POST {gw}/images/generate)"))
        say(st.dim("Running; Ctrl-C to stop."))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        if server is not None:
            await server.shutdown()
        await gpu_a.stop()
        await gpu_b.stop()


def _failovers(server: object) -> float:
    assert isinstance(server, Server)
    total = 0.0
    for metric in server.rt.metrics.failovers.metric.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total
