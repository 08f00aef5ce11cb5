#!/usr/bin/env python3
"""Chaos under traffic: node kills and restarts, hangs, slow drips, 500 storms, notifier outages,
reloads (valid and invalid) and client disconnects, while sync / sse / async traffic runs.

At the end it asserts what a gateway owes its clients and its operator:

- every request is accounted for: a 2xx; an error type of docs/API.md "Errors" in a JSON body; a node's own
  status passed through (X-KiloLine-Node set); an SSE/async job that ended `completed` or
  `failed` with a SPEC type (or `cancelled`); a client-side cancel we did ourselves; or a
  connection cut — only *after* the response headers and only for a request whose node was
  killed while it ran (docs/API.md: no honest error can be written once bytes went out);
- no slot leaked: once idle, every route of /admin/state has inflight 0 and queue_depth 0;
- the gateway's open file descriptors (and, in-process, its asyncio task count) are back to
  the baseline taken before the chaos (keep-alive pools are flushed the same way both times).

The core, ``run_chaos(env, …)``, is shared by this script (gateway and nodes as subprocesses,
`--seconds`, default 120) and by tests/test_chaos.py (everything in-process, ~25 s).

    .venv/bin/python scripts/chaos.py [--quick] [--seconds 120] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

SPEC_TYPES = frozenset({
    "bad_request", "unauthorized", "forbidden", "not_found", "payload_too_large", "not_ready", "rate_limited",
    "budget_exhausted", "queue_full", "upstream_error", "queue_timeout", "shutting_down", "upstream_timeout",
})
TERMINAL = ("completed", "failed", "cancelled")

# --------------------------------------------------------------------------- traffic (also used by soak.py)


@dataclass
class Outcome:
    mode: str
    kind: str  # ok | gw:<type> | node:<status> | job_failed:<type> | cut_mid_stream | client_cancelled | violation:…
    started: float
    ended: float = 0.0
    status: int | None = None
    node: str | None = None
    headers: bool = False  # response headers had arrived
    queue_wait: float | None = None
    detail: str = ""

    @property
    def duration(self) -> float:
        return self.ended - self.started


def classify_error(status: int, raw: bytes, node: str | None) -> str:
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    if isinstance(err, dict) and err.get("type") in SPEC_TYPES:
        return f"gw:{err['type']}"
    if node:
        return f"node:{status}"  # the node's own answer, passed through unchanged (docs/API.md)
    return f"violation:non-spec error {status} {raw[:80]!r}"


async def sync_request(s: aiohttp.ClientSession, base: str, body: dict[str, Any], out: Outcome) -> None:
    async with s.post(f"{base}/gen/generate", json=body, headers=bl.API_HDR) as r:
        out.headers, out.status, out.node = True, r.status, r.headers.get("X-KiloLine-Node")
        with contextlib.suppress(ValueError, TypeError):
            out.queue_wait = int(r.headers.get("X-KiloLine-Queue-Wait-Ms", "")) / 1000
        raw = await r.read()
    out.kind = "ok" if r.status < 300 else classify_error(r.status, raw, out.node)


async def sse_request(s: aiohttp.ClientSession, base: str, body: dict[str, Any], out: Outcome) -> None:
    headers = {**bl.API_HDR, "X-KiloLine-Mode": "sse"}
    async with s.post(f"{base}/gen/generate", json=body, headers=headers) as r:
        out.headers, out.status = True, r.status
        if r.status != 200:
            out.kind = classify_error(r.status, await r.read(), None)
            return
        event = None
        async for line in r.content:
            if line.startswith(b"event: "):
                event = line[7:].strip().decode()
            elif line.startswith(b"data: ") and event:
                data = json.loads(line[6:])
                if event == "dispatched":
                    out.node = data.get("node")
                    if out.queue_wait is None:
                        out.queue_wait = data.get("queue_wait_sec")
                elif event == "output_ready":
                    out.kind = "ok"
                    return
                elif event == "failed":
                    t = (data.get("error") or {}).get("type")
                    out.kind = f"job_failed:{t}" if t in SPEC_TYPES or t == "cancelled" else \
                        f"violation:failed event with type {t!r}"
                    return
        out.kind = "violation:sse stream ended without output_ready/failed"


async def async_request(s: aiohttp.ClientSession, base: str, body: dict[str, Any], out: Outcome,
                        poll_deadline: float) -> None:
    headers = {**bl.API_HDR, "Prefer": "respond-async"}
    async with s.post(f"{base}/gen/generate", json=body, headers=headers) as r:
        out.headers, out.status = True, r.status
        raw = await r.read()
    if r.status != 202:
        out.kind = classify_error(r.status, raw, None)
        return
    job = json.loads(raw)
    while time.monotonic() < poll_deadline:
        await asyncio.sleep(0.25)
        async with s.get(f"{base}/v1/jobs/{job['job_id']}", headers=bl.API_HDR) as r:
            st = await r.json()
        if st.get("status") in TERMINAL:
            out.node = st.get("node")
            if st.get("started_at") and st.get("created_at"):
                out.queue_wait = st["started_at"] - st["created_at"]
            if st["status"] == "completed":
                out.kind = "ok"
            else:
                t = (st.get("error") or {}).get("type")
                out.kind = f"job_failed:{t}" if t in SPEC_TYPES or t == "cancelled" else \
                    f"violation:job error type {t!r}"
            return
    out.kind = "violation:async job not terminal in time"


class Traffic:
    """`workers` loops, each sending one request at a time (mixed modes) until ``stop()``."""

    def __init__(self, base: str, rng: random.Random, workers: int, client_timeout: float,
                 mix: tuple[float, float, float] = (0.6, 0.25, 0.15), steps: tuple[int, int] = (1, 4),
                 step_ms: tuple[int, int] = (10, 50), stream_share: float = 0.4):
        self.base, self.rng, self.workers = base, rng, workers
        self.client_timeout = client_timeout
        self.mix, self.steps, self.step_ms, self.stream_share = mix, steps, step_ms, stream_share
        self.outcomes: list[Outcome] = []
        self.inflight: dict[asyncio.Task[None], Outcome] = {}
        self._stop = asyncio.Event()
        self._expired: set[int] = set()  # ids of outcomes cut short by stop(): not client cancels
        self._loops: list[asyncio.Task[None]] = []
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=self.client_timeout))
        self._loops = [asyncio.create_task(self._loop()) for _ in range(self.workers)]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            t = asyncio.create_task(self.one())
            try:
                await asyncio.shield(t)
            except asyncio.CancelledError:
                if not t.done():
                    raise
            await asyncio.sleep(self.rng.uniform(0, 0.05))

    async def one(self) -> None:
        rng = self.rng
        x = rng.random()
        mode = "sync" if x < self.mix[0] else "sse" if x < self.mix[0] + self.mix[1] else "async"
        body: dict[str, Any] = {"steps": rng.randint(*self.steps), "step_ms": rng.randint(*self.step_ms)}
        if mode == "sync" and rng.random() < self.stream_share:
            body["stream"] = True
        out = Outcome(mode, "violation:unfinished", time.monotonic())
        me = asyncio.current_task()
        assert me is not None and self.session is not None
        self.inflight[me] = out
        try:
            if mode == "sync":
                await sync_request(self.session, self.base, body, out)
            elif mode == "sse":
                await sse_request(self.session, self.base, body, out)
            else:
                await async_request(self.session, self.base, body, out, time.monotonic() + self.client_timeout)
        except asyncio.CancelledError:
            out.kind = ("violation:client timeout (still running at the end)" if id(out) in self._expired
                        else "client_cancelled")
        except TimeoutError:
            out.kind = "violation:client timeout (no answer in time)"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            out.detail = f"{type(e).__name__}: {e}"[:200]
            out.kind = "cut_mid_stream" if out.headers else "violation:connection cut before response headers"
        finally:
            out.ended = time.monotonic()
            self.inflight.pop(me, None)
            self.outcomes.append(out)

    def cancel_random(self, n: int) -> int:
        """Client disconnects: cancel n random in-flight requests."""
        tasks = [t for t in self.inflight if not t.done()]
        picked = self.rng.sample(tasks, min(n, len(tasks)))
        for t in picked:
            t.cancel()
        return len(picked)

    async def stop(self, drain_timeout: float) -> None:
        self._stop.set()
        _, pending = await asyncio.wait(self._loops, timeout=drain_timeout) if self._loops else (set(), set())
        for t in pending:
            t.cancel()
        for t, out in list(self.inflight.items()):
            self._expired.add(id(out))
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self.session is not None:
            await self.session.close()


# --------------------------------------------------------------------------- the pieces under chaos


class FakeTelegram:
    """A tiny Bot API stand-in that can go down for real (listener closed, connections reset)."""

    def __init__(self) -> None:
        self.port = bl.free_port()
        self.messages: list[str] = []
        self.requests = 0
        app = web.Application()
        app.router.add_post("/bot{token}/sendMessage", self._send)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        self._site: web.TCPSite | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _send(self, request: web.Request) -> web.Response:
        self.requests += 1
        data = await request.json()
        self.messages.append(str(data.get("text", "")))
        result = {"message_id": len(self.messages), "date": int(time.time()), "chat": {"id": data.get("chat_id")},
                  "text": data.get("text")}
        return web.json_response({"ok": True, "result": result})

    async def start(self) -> None:
        await self._runner.setup()
        await self.up()

    async def up(self) -> None:
        if self._site is None:
            self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
            await self._site.start()

    async def down(self) -> None:
        site, self._site = self._site, None
        if site is not None:
            await site.stop()
        server = self._runner.server
        for conn in list(server.connections) if server is not None else []:
            if conn.transport is not None:
                conn.transport.abort()

    async def stop(self) -> None:
        await self.down()
        await self._runner.cleanup()


class NodeHandle:
    """What chaos does to a node; implemented in-process (FakeGPU) and as a subprocess."""

    name: str
    url: str

    async def kill(self) -> None:
        raise NotImplementedError

    async def revive(self) -> None:
        raise NotImplementedError

    async def control(self, **knobs: Any) -> None:
        raise NotImplementedError


class InprocNode(NodeHandle):
    def __init__(self, name: str, gpu: Any):
        self.name, self.gpu, self.url = name, gpu, gpu.url

    async def kill(self) -> None:
        await self.gpu.kill()

    async def revive(self) -> None:
        if not self.gpu.up:
            await self.gpu.revive()

    async def control(self, **knobs: Any) -> None:
        self.gpu.set_control(**knobs)


class ProcNode(NodeHandle):
    """`kilolined fakegpu` in its own process group; kill = SIGKILL (a spot machine vanishing)."""

    def __init__(self, name: str, procs: bl.Procs, port: int, steps: int = 2, step_ms: float = 20):
        self.name, self.procs, self.port = name, procs, port
        self.url = f"http://127.0.0.1:{port}"
        self.kw = {"steps": steps, "step_ms": step_ms}
        self.proc: Any = None

    async def start(self) -> None:
        self.proc = self.procs.start(bl.fakegpu_cmd(self.port, **self.kw), f"node-{self.name}")
        await asyncio.to_thread(bl.wait_port, self.port, 15.0, self.proc)

    async def kill(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(self.procs.kill, self.proc)
            self.proc = None

    async def revive(self) -> None:
        if self.proc is None:
            await self.start()

    async def control(self, **knobs: Any) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s, \
                    s.post(self.url + "/_fake/control", json=knobs) as r:
                await r.read()


@dataclass
class ChaosEnv:
    """The gateway under test and its surroundings."""

    base: str  # http://127.0.0.1:PORT
    config_path: Path
    listen: str
    nodes: dict[str, NodeHandle]
    telegram: FakeTelegram
    # Readings compared before/after: {"fds_nonpool": n, …}; see COMPARED.
    resources: Callable[[], dict[str, int]]
    request_timeout: float = 2.0
    queue_timeout: float = 6.0


def chaos_config(env: ChaosEnv, max_concurrency: int = 2, retry: int = 1) -> dict[str, Any]:
    names = list(env.nodes)
    nodes = {n: {"url": h.url, "label": f"fake {n}",
                 "health": {"path": "/health", "interval_sec": 0.5, "timeout_sec": 0.5, "fall": 2, "rise": 2},
                 "breaker": {"consecutive_failures": 3, "open_sec": 1, "max_open_sec": 4, "slow_start_sec": 2}}
             for n, h in env.nodes.items()}
    route = {"path": "/gen", "nodes": names[:1], "standby": names[1:], "max_concurrency": max_concurrency,
             "max_queue_depth": 200, "queue_timeout_sec": env.queue_timeout,
             "request_timeout_sec": env.request_timeout, "retry_on_failover": retry}
    cfg = bl.gateway_config(int(env.listen.rsplit(":", 1)[1]), {}, {"gen": route}, heartbeat_sec=1,
                            shutdown_grace_sec=2)
    cfg["nodes"] = nodes
    cfg["notify"] = {"telegram": {"bot_token": "123:chaos", "chat_id": "42", "api_base": env.telegram.url},
                     "min_interval_sec": 1, "group_sec": 0.5}
    cfg["jobs"] = {"result_ttl_sec": 30}
    return cfg


async def admin(s: aiohttp.ClientSession, env: ChaosEnv, method: str, path: str) -> tuple[int, Any]:
    async with s.request(method, env.base + path, headers=bl.ADMIN_HDR) as r:
        return r.status, await r.json()


async def flush_pools(env: ChaosEnv, settle: float = 1.5) -> None:
    """Close every idle keep-alive connection the same way before both resource readings: kill and
    revive the nodes, bounce the notifier fake; then let health checks re-open their one each."""
    for h in env.nodes.values():
        await h.kill()
    await env.telegram.down()
    await asyncio.sleep(0.3)
    for h in env.nodes.values():
        await h.revive()
    await env.telegram.up()
    await asyncio.sleep(settle)


# What must be back to baseline: fds other than idle keep-alive sockets to/from nodes and the
# notifier (their count is reported, not compared: a notifier retry may open one at any time), the
# asyncio tasks other than per-connection server handlers, and the gateway's client connections.
COMPARED = ("fds_nonpool", "tasks", "gateway_conns")


def compared(reading: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in reading.items() if k in COMPARED}


async def settle_resources(env: ChaosEnv, want: dict[str, int] | None, timeout: float = 10.0
                           ) -> dict[str, int]:
    """Sample until the compared part of the reading equals `want`'s (or the time is up)."""
    end = time.monotonic() + timeout
    reading = env.resources()
    while want is not None and compared(reading) != compared(want) and time.monotonic() < end:
        await asyncio.sleep(0.25)
        reading = env.resources()
    return reading


@dataclass
class ChaosReport:
    seconds: float
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    idle_state: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, int] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    notifier_messages: int = 0
    total: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


async def run_chaos(env: ChaosEnv, seconds: float, seed: int = 1, workers: int = 12,
                    log: Callable[[str], None] = print) -> ChaosReport:
    rng = random.Random(seed)
    report = ChaosReport(seconds)
    kills: list[tuple[str, float]] = []  # (node, when): cuts mid-stream are excused only around these
    actions: Counter[str] = Counter()
    bl.write_yaml(env.config_path, chaos_config(env))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl:
        await admin(ctl, env, "POST", "/admin/reload")
        # Warm-up: one request of each mode, so that lazily made objects exist before the baseline.
        warm = Traffic(env.base, random.Random(0), 3, 30, steps=(1, 1), step_ms=(5, 5))
        warm.start()
        await asyncio.sleep(1.0)
        await warm.stop(20)
    await flush_pools(env)
    report.baseline = await settle_resources(env, None)
    log(f"baseline resources: {report.baseline}")

    traffic = Traffic(env.base, rng, workers, client_timeout=4 * (env.queue_timeout + env.request_timeout) + 10)
    traffic.start()
    end = time.monotonic() + seconds
    down: set[str] = set()
    restore: list[tuple[float, str, Callable[[], Awaitable[None]]]] = []

    async def later(delay: float, what: str, fn: Callable[[], Awaitable[None]]) -> None:
        restore.append((time.monotonic() + delay, what, fn))

    max_conc = 2
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl:
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            now = time.monotonic()
            for item in [r for r in restore if r[0] <= now]:
                restore.remove(item)
                await item[2]()
            action = rng.choice(["kill", "hang", "drip", "storm500", "storm503", "notifier_down", "reload",
                                 "bad_reload", "disconnect", "disconnect"])
            node_name = rng.choice(list(env.nodes))
            h = env.nodes[node_name]
            if action == "kill" and node_name not in down and len(down) < len(env.nodes) - 1:
                down.add(node_name)
                kills.append((node_name, time.monotonic()))
                await h.kill()

                async def revive(h: NodeHandle = h, n: str = node_name) -> None:
                    await h.revive()
                    down.discard(n)

                await later(rng.uniform(1, 3), "revive", revive)
            elif action == "hang" and node_name not in down:
                await h.control(hang=True)
                await later(rng.uniform(1, 2.5), "unhang", lambda h=h: h.control(hang=False))
            elif action == "drip" and node_name not in down:
                await h.control(drip_ms=rng.choice([30, 80]))
                await later(rng.uniform(1, 3), "undrip", lambda h=h: h.control(drip_ms=0))
            elif action in ("storm500", "storm503") and node_name not in down:
                await h.control(fail_status=int(action[-3:]))
                await later(rng.uniform(0.5, 2), "unstorm", lambda h=h: h.control(fail_status=None))
            elif action == "notifier_down":
                await env.telegram.down()
                await later(rng.uniform(1, 4), "notifier_up", env.telegram.up)
            elif action == "reload":
                max_conc = 3 if max_conc != 3 else 1
                bl.write_yaml(env.config_path, chaos_config(env, max_concurrency=max_conc,
                                                            retry=rng.choice([0, 1, 2])))
                status, _ = await admin(ctl, env, "POST", "/admin/reload")
                if status != 200:
                    report.problems.append(f"valid reload answered {status}")
            elif action == "bad_reload":
                env.config_path.write_text("routes: {gen: {path: /gen, nodes: [nope]}}\nnodes: {}\n")
                status, _ = await admin(ctl, env, "POST", "/admin/reload")
                if status != 422:
                    report.problems.append(f"invalid reload answered {status}, not 422")
                bl.write_yaml(env.config_path, chaos_config(env, max_concurrency=max_conc))
                await admin(ctl, env, "POST", "/admin/reload")
            elif action == "disconnect":
                actions["cancelled_requests"] += traffic.cancel_random(rng.randint(1, 3))
            else:
                continue
            actions[action] += 1
        # Chaos over: put everything back, then let the traffic finish.
        for _, _, fn in restore:
            await fn()
        for h in env.nodes.values():
            await h.revive()
            await h.control(hang=False, drip_ms=0, fail_status=None)
        await env.telegram.up()
        bl.write_yaml(env.config_path, chaos_config(env))
        await admin(ctl, env, "POST", "/admin/reload")
    report.actions = dict(actions)
    log(f"chaos over after {seconds:g}s: {dict(actions)}; draining traffic …")
    await traffic.stop(drain_timeout=2 * (env.queue_timeout + env.request_timeout) + 10)

    # 1. every request accounted for
    by_mode: dict[str, Counter[str]] = {}
    for o in traffic.outcomes:
        by_mode.setdefault(o.mode, Counter())[o.kind] += 1
        if o.kind == "cut_mid_stream" and not any(n == o.node and o.started - 0.2 <= t <= o.ended + 0.2
                                                  for n, t in kills):
            report.violations.append(f"{o.mode} cut mid-stream on {o.node} with no kill of that node: {o.detail}")
        elif o.kind.startswith("violation:"):
            report.violations.append(f"{o.mode} {o.kind} status={o.status} node={o.node} after "
                                     f"{o.duration:.1f}s {o.detail}")
    report.outcomes = {m: dict(c) for m, c in by_mode.items()}
    report.total = len(traffic.outcomes)
    if report.violations:
        report.problems.append(f"{len(report.violations)} requests not accounted for")
    # 2. no slot leaked
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as ctl:
        deadline = time.monotonic() + 2 * (env.queue_timeout + env.request_timeout) + 5
        while True:
            _, st = await admin(ctl, env, "GET", "/admin/state")
            busy = {r: (v["inflight"], v["queue_depth"]) for r, v in st["routes"].items()
                    if v["inflight"] or v["queue_depth"]}
            nbusy = {n: v["inflight"] for n, v in st["nodes"].items() if v["inflight"]}
            if (not busy and not nbusy) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        report.idle_state = {"routes": {r: {"inflight": v["inflight"], "queue_depth": v["queue_depth"]}
                                        for r, v in st["routes"].items()},
                             "nodes": {n: v["inflight"] for n, v in st["nodes"].items()},
                             "config_last_error": st["config"]["last_error"]}
        if busy or nbusy:
            report.problems.append(f"slots not released when idle: routes {busy} nodes {nbusy}")
    # 3. resources back to baseline
    await flush_pools(env)
    report.final = await settle_resources(env, report.baseline)
    if compared(report.final) != compared(report.baseline):
        report.problems.append(f"resources not back to baseline: {report.baseline} -> {report.final}")
    report.notifier_messages = len(env.telegram.messages)
    return report


def print_report(r: ChaosReport) -> None:
    print(f"\n## Chaos: {r.seconds:g} s, {r.total} requests")
    print(f"actions: {r.actions}")
    rows = [[mode, kind, n] for mode, kinds in sorted(r.outcomes.items()) for kind, n in sorted(kinds.items())]
    bl.print_table(["mode", "outcome", "count"], rows)
    print(f"\nidle state after: {r.idle_state}")
    print(f"resources: baseline {r.baseline} -> final {r.final}")
    print(f"notifier messages received by the fake Telegram: {r.notifier_messages}")
    for v in r.violations[:20]:
        print(f"  VIOLATION {v}")
    print("RESULT: " + ("PASS" if r.ok else "FAIL: " + "; ".join(r.problems)))


# --------------------------------------------------------------------------- the script: subprocesses


async def script_main(seconds: float, seed: int, workers: int) -> ChaosReport:
    with bl.workdir("chaos") as wd, bl.Procs(wd) as procs:
        tg = FakeTelegram()
        await tg.start()
        try:
            nodes: dict[str, NodeHandle] = {}
            for name in ("a", "b"):
                n = ProcNode(name, procs, bl.free_port())
                await n.start()
                nodes[name] = n
            port = bl.free_port()
            env = ChaosEnv(base=f"http://127.0.0.1:{port}", config_path=wd / "kiloline.yaml",
                           listen=f"127.0.0.1:{port}", nodes=nodes, telegram=tg, resources=lambda: {})
            gw, _ = await asyncio.to_thread(bl.start_gateway, procs, chaos_config(env), "gateway")
            env.config_path = wd / "gateway.yaml"
            pool_ports = {h.port for h in nodes.values() if isinstance(h, ProcNode)} | {tg.port}
            env.resources = lambda: {**bl.fd_breakdown(gw.pid, pool_ports),
                                     "threads": bl.proc_status(gw.pid)["Threads"]}
            report = await run_chaos(env, seconds, seed=seed, workers=workers)
            if gw.poll() is not None:
                report.problems.append(f"gateway exited with {gw.returncode}")
            tail = [ln for ln in procs.log_tail("gateway", 400).splitlines() if "Traceback" in ln or "ERROR" in ln]
            if tail:
                print("gateway log errors (last):\n  " + "\n  ".join(tail[-10:]))
            return report
        finally:
            await tg.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 s of chaos")
    ap.add_argument("--seconds", type=float, default=None, help="chaos duration (default 120, quick 30)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=16, help="concurrent client loops")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    seconds = args.seconds or (30.0 if args.quick else 120.0)
    bl.install_sigterm_exit()
    bl.raise_nofile()
    machine = bl.print_machine()
    try:
        import uvloop

        report = uvloop.run(script_main(seconds, args.seed, args.workers))
    except ImportError:
        report = asyncio.run(script_main(seconds, args.seed, args.workers))
    print_report(report)
    bl.write_json(args.json, {"machine": machine, "report": report.__dict__})
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

