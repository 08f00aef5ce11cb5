"""``kilolined demo``: the traffic-smoothing demo, all on loopback, nothing but the package.

Two simulated 24 GB GPUs (10 GB per job: two fit, the third OOMs). The same burst of 10
concurrent requests goes first straight at one card, then through the gateway with
``max_concurrency: 2``; then a burst with the primary killed midway shows the failover.
Last, a mixed burst (large and small images) on a third card whose jobs take the VRAM they
need: fixed slots either leave half the card idle or run it out of memory; cost-aware
admission (docs/CONFIG.md#cost-and-capacity) keeps it full and never crashes it.
Then the same chat conversations on three LLM nodes that cache prompts as llama.cpp does, with
`affinity: off` (least-loaded) and `affinity: prefix` (docs/CONFIG.md#affinity): time to first
token and the share of prompt tokens the nodes report cached, side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU
from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_vastai import VastWire

BURST = 10
STEPS, STEP_MS = 8, 100  # 0.8 s per image
# the mixed burst: 1 in 4 is a large image; what each takes on the 24 GB card
MIXED_BURST, LARGE_GB, SMALL_GB, MIXED_STEPS = 24, 12.0, 3.0, 4
SAFE_SLOTS, FAST_SLOTS, CARD_CAPACITY = 2, 6, 22  # 2 × 12 GB fit; 6 is "for throughput"
# the conversations: 3 users with 3 chats each on 3 LLM nodes of 2 slots; a 1000-word prompt
# costs a node 400 ms to prefill unless it holds it, and each node holds about 3 chats
LLM_NODES, LLM_SLOTS, CHAT_USERS, CHATS_EACH, CHAT_TURNS = 3, 2, 3, 3, 4
PREFILL_MS_PER_1K, LLM_STEP_MS, LLM_CACHE_TOKENS, CHAT_REPLY_TOKENS = 400, 10, 1500, 6
CHAT_WORDS = ("river", "lantern", "harbor", "copper", "meadow", "signal", "orbit", "cedar", "violet", "engine",
              "quartz", "summit", "window", "falcon", "ember", "glacier", "pepper", "tundra", "marble", "canyon")


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


async def fire(session: aiohttp.ClientSession, url: str, headers: dict[str, str], i: int,
               body: dict[str, object] | None = None) -> Outcome:
    t0 = time.monotonic()
    try:
        async with session.post(url, json=body or {"echo": i}, headers=headers) as r:
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


def mixed_sizes(n: int) -> list[float]:
    return [LARGE_GB if i % 4 == 0 else SMALL_GB for i in range(n)]


def gateway_config(primary: str, standby: str, admin_key: str, key: str, port: int, mixed: str = "",
                   llm: tuple[list[str], list[str]] | None = None) -> str:
    extra_nodes = (mixed_nodes(mixed) if mixed else "") + (llm_nodes(*llm) if llm else "")
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
          health: {{path: /health, interval_sec: 0.25, timeout_sec: 0.5, fall: 1, rise: 2}}}}{extra_nodes}
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
{mixed_routes() if mixed else ""}{llm_routes() if llm else ""}
cost: {{gpu_hourly_usd: 0.30, serverless_per_sec_usd: 0.0011}}
"""


def mixed_nodes(url: str) -> str:
    """The mixed card under two names: one judged by slots only, one with a capacity."""
    return f"""
  card-slots: {{url: "{url}", label: "RTX 4090 #C (slots)", breaker: {{open_sec: 1, slow_start_sec: 0}}}}
  card-cost: {{url: "{url}", label: "RTX 4090 #C (capacity)", capacity: {CARD_CAPACITY}}}"""


def mixed_routes() -> str:
    common = "max_queue_depth: 500, queue_timeout_sec: 60, retry_on_failover: 0"
    return f"""
  mixed-safe: {{path: /mixed-safe, nodes: [card-slots], max_concurrency: {SAFE_SLOTS}, {common}}}
  mixed-fast: {{path: /mixed-fast, nodes: [card-slots], max_concurrency: {FAST_SLOTS}, {common}}}
  mixed-cost: {{path: /mixed, nodes: [card-cost], max_concurrency: 8, {common},
               cost: {{base: 0, per_unit: 1, unit: "json:/vram_gb"}}}}"""


def llm_nodes(off: list[str], prefix: list[str]) -> str:
    """Two sets of three LLM nodes, one per route, so that each starts with empty caches."""
    lines = [f"""
  llm-{tag}{i + 1}: {{url: "{url}", label: "LLM #{i + 1} ({label})"}}"""
             for tag, label, urls in (("off", "affinity off", off), ("pre", "affinity prefix", prefix))
             for i, url in enumerate(urls)]
    return "".join(lines)


def llm_routes() -> str:
    common = (f"kind: openai, strip_path: true, max_concurrency: {LLM_SLOTS}, max_queue_depth: 100, "
              "queue_timeout_sec: 60, retry_on_failover: 0")
    nodes = {tag: ", ".join(f"llm-{tag}{i + 1}" for i in range(LLM_NODES)) for tag in ("off", "pre")}
    return f"""
  chat-off: {{path: /chat-off, nodes: [{nodes["off"]}], {common}}}
  chat-prefix: {{path: /chat-prefix, nodes: [{nodes["pre"]}], affinity: prefix, {common}}}"""


@dataclass
class ChatTurn:
    ttft_ms: float
    cached: int
    prompt: int
    ok: bool


def chat_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(CHAT_WORDS) for _ in range(n))


async def chat_turn(http: aiohttp.ClientSession, url: str, hdr: dict[str, str],
                    messages: list[dict[str, str]]) -> tuple[ChatTurn, str]:
    """One streamed turn: its time to first token, what the node reported cached, the reply."""
    body = {"model": "fake-llm", "messages": messages, "max_tokens": CHAT_REPLY_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    ttft, reply = float("nan"), ""
    timings: dict[str, Any] = {}
    async with http.post(url, json=body, headers=hdr) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece and not reply:
                    ttft = (time.monotonic() - t0) * 1000
                reply += piece or ""
            timings = event.get("timings") or timings
        ok = r.status == 200 and bool(timings)
    cached = int(timings.get("cache_n", 0))
    return ChatTurn(ttft, cached, cached + int(timings.get("prompt_n", 0)), ok), reply


async def chat_user(http: aiohttp.ClientSession, url: str, hdr: dict[str, str], user: int) -> list[ChatTurn]:
    """One user taking turns in their chats; seeded, so both routes get the very same words and pauses."""
    rng = random.Random(user)
    chats = [[{"role": "user", "content": f"Chat {user}.{c}: " + chat_words(rng, 300)}] for c in range(CHATS_EACH)]
    out: list[ChatTurn] = []
    for turn in range(CHAT_TURNS):
        for chat in chats:
            await asyncio.sleep(rng.uniform(0, 0.05))  # a pause, so that users do not move in lock step
            if turn:
                chat.append({"role": "user", "content": chat_words(rng, 20) + "?"})
            result, reply = await chat_turn(http, url, hdr, chat)
            chat.append({"role": "assistant", "content": reply})
            out.append(result)
    return out


async def chat_scene(http: aiohttp.ClientSession, gw: str, hdr: dict[str, str], path: str) -> list[ChatTurn]:
    users = await asyncio.gather(*[chat_user(http, gw + path, hdr, u) for u in range(CHAT_USERS)])
    return [t for turns in users for t in turns]


def chat_line(turns: list[ChatTurn]) -> tuple[str, float, float]:
    """(the line to print, TTFT p50 in ms, cached share in %)."""
    ttfts = sorted(t.ttft_ms for t in turns if t.ok)
    p50 = statistics.median(ttfts) if ttfts else float("nan")
    p95 = ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.95))] if ttfts else float("nan")
    prompt = sum(t.prompt for t in turns)
    share = 100 * sum(t.cached for t in turns) / prompt if prompt else 0.0
    served = sum(t.ok for t in turns)
    return (f"TTFT p50 {p50:4.0f} ms, p95 {p95:4.0f} ms; cached share {share:3.0f} %; "
            f"{served}/{len(turns)} served"), p50, share


async def mixed_scene(http: aiohttp.ClientSession, gw: str, hdr: dict[str, str], gpu: FakeGPU,
                      path: str) -> tuple[list[Outcome], float, dict[str, object]]:
    """One mixed burst through one route; (outcomes, seconds, the card's stats after it)."""
    gpu.reset()
    sizes = mixed_sizes(MIXED_BURST)
    t0 = time.monotonic()
    res = await asyncio.gather(*[fire(http, gw + path, hdr, i, {"vram_gb": gb, "steps": MIXED_STEPS})
                                 for i, gb in enumerate(sizes)])
    return list(res), time.monotonic() - t0, dict(gpu.stats)


async def start_gateway(config_for: Callable[[int], str], port: int) -> Server:
    """The gateway on ``port``, else (taken, or not allowed) on any free port."""
    try:
        return await started(config_for(port))
    except OSError:
        if port == 0:
            raise
    return await started(config_for(0))


async def started(text: str) -> Server:
    """A started gateway. A start that fails is shut down: it has already opened its health
    checker's and notifier's sessions, which would otherwise stay open (and keep checking)."""
    server = Server(parse_config(text, env={}), hashlib.sha256(text.encode()).hexdigest(), None)
    try:
        await server.start()
    except BaseException:
        await server.shutdown()
        raise
    return server


async def run_demo(once: bool, port: int = 8080, out: TextIO | None = None) -> int:
    stream = out or sys.stdout
    st = Style(hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR"))

    def say(s: str = "") -> None:
        print(s, file=stream, flush=True)

    gpu_a = FakeGPU("generic", vram_gb=24, job_vram_gb=10, steps=STEPS, step_ms=STEP_MS, crash_sec=2)
    gpu_b = FakeGPU("generic", vram_gb=24, job_vram_gb=10, steps=STEPS, step_ms=STEP_MS, crash_sec=2)
    gpu_c = FakeGPU("generic", vram_gb=24, capacity_mode="request", steps=MIXED_STEPS, step_ms=STEP_MS, crash_sec=2)
    llms = {tag: [FakeGPU("openai", step_ms=LLM_STEP_MS, job_vram_gb=1, prefill_ms_per_1k=PREFILL_MS_PER_1K,
                          prompt_cache_tokens=LLM_CACHE_TOKENS) for _ in range(LLM_NODES)] for tag in ("off", "pre")}
    cards = [gpu_a, gpu_b, gpu_c, *llms["off"], *llms["pre"]]
    for card in cards:
        await card.start()
    llm_urls = ([g.url for g in llms["off"]], [g.url for g in llms["pre"]])
    market = await fleet_market()
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
            server = await start_gateway(
                lambda p: with_fleet(gateway_config(gpu_a.url, gpu_b.url, admin_key, key, p, gpu_c.url, llm_urls),
                                     market.url), port)
            if port and server.port != port:
                say(st.yellow(f"   port {port} is taken: the gateway listens on {server.port} instead"))
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
            # 4. cost-aware admission
            say()
            say(st.bold(f"4) A mixed burst on a 24 GB card: {MIXED_BURST} images, 1 in 4 large "
                        f"({LARGE_GB:g} GB), the rest small ({SMALL_GB:g} GB)"))
            cost_ok = True
            scenes = ((f"fixed max_concurrency: {SAFE_SLOTS} (safe)", "/mixed-safe/generate"),
                      (f"fixed max_concurrency: {FAST_SLOTS} (for throughput)", "/mixed-fast/generate"),
                      (f"cost-aware, capacity: {CARD_CAPACITY}", "/mixed/generate"))
            for label, path in scenes:
                res, took, stats = await mixed_scene(http, gw, hdr, gpu_c, path)
                served = summary(res).get("200", 0)
                line = (f"{served}/{MIXED_BURST} served, oom_count={stats['oom_count']}, "
                        f"peak {stats['peak_vram_gb']:g}/24 GB, up to {stats['max_concurrent']} at once, "
                        f"done in {took:.1f}s")
                good = stats["oom_count"] == 0 and served == MIXED_BURST
                say(f"   {label:<42} {bar(res, st)}")
                say(f"   {'':<42} {st.green(line) if good else st.red(line)}")
                if path == "/mixed/generate":
                    cost_ok = good
                if stats["crashes"]:
                    await asyncio.sleep(gpu_c.crash_sec + 1.2)  # the card comes back, its breaker closes
            say(st.dim("   slots count requests; capacity counts what they hold: small images fill the room "
                       "a large one leaves, and no mix overflows the card"))
            # 5. prefix affinity (6, the fleet, follows)
            say()
            say(st.bold(f"5) {CHAT_USERS} users, {CHATS_EACH} chats each, {CHAT_TURNS} turns, on {LLM_NODES} LLM "
                        f"nodes that cache prompts (a cold prompt costs {PREFILL_MS_PER_1K} ms per 1000 tokens)"))
            chat_ok = True
            for label, path in (("affinity: off (least-loaded)", "/chat-off/v1/chat/completions"),
                                ("affinity: prefix", "/chat-prefix/v1/chat/completions")):
                turns = await chat_scene(http, gw, hdr, path)
                line, _, _ = chat_line(turns)
                chat_ok = chat_ok and all(t.ok for t in turns)
                say(f"   {label:<30} {st.green(line) if all(t.ok for t in turns) else st.red(line)}")
            say(st.dim("   with affinity each chat goes back to the node that holds its history: fewer prompts "
                       "computed again, a shorter wait for the first token"))
            fleet_ok = await fleet_scene(http, say, st, server, market, gw, hdr)
        say()
        say(st.bold("Dashboard: ") + f"{gw}/dashboard")
        say(st.bold("Admin key: ") + admin_key)
        say(st.bold("API key:   ") + key + st.dim(f"   (try: curl -H 'Authorization: Bearer {key}' "
                                                   f"-X POST {gw}/images/generate)"))
        if once:
            say(st.dim("--once: the gateway stops here; run `kilolined demo` to keep it up and "
                       "watch the same bursts on its dashboard."))
            return 0 if s.get("200") == BURST and cost_ok and chat_ok and fleet_ok else 1
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
        for card in cards:
            await card.stop()
        await market.stop()


def _failovers(server: object) -> float:
    assert isinstance(server, Server)
    return server.rt.metrics.failovers.total()


# --- 5. the self-healing fleet (docs/FLEET.md) ----------------------------------------------------

FLEET_BOOT_SEC = 0.5
FLEET_API_KEY = "demo-vast-key"
FLEET_POOL = "spot-4090"


async def fleet_market() -> FakeProvider:
    """The fake Vast.ai market the demo's pool rents from (instances boot in FLEET_BOOT_SEC)."""
    market = FakeProvider(VastWire(), api_key=FLEET_API_KEY, boot_sec=FLEET_BOOT_SEC,
                          card_options={"steps": STEPS, "step_ms": STEP_MS})
    await market.start()
    return market


def with_fleet(config: str, market: str) -> str:
    """The demo's config plus a route /spot served by a pool of 2 rented spot GPUs."""
    health = "{path: /health, interval_sec: 0.2, timeout_sec: 0.5, fall: 2, rise: 1}"
    route = ("  spot: {path: /spot, nodes: [], max_concurrency: 2, queue_timeout_sec: 60, "
             "retry_on_failover: 3}\n")
    head, sep, tail = config.partition("\ncost:")
    return head + "\n" + route.rstrip("\n") + sep + tail + f"""
fleet:
  providers: {{vast: {{kind: vastai, api_key: "{FLEET_API_KEY}", api_base: "{market}"}}}}
  pools:
    {FLEET_POOL}:
      provider: vast
      size: 2
      offer: {{gpu_name: "RTX 4090", max_dph: 0.45, min_reliability: 0.97}}
      template: {{image: "fake/generic", env: {{FAKEGPU_KIND: generic}}, port: 8080}}
      node: {{health: {health}, label: "Vast {{id}}"}}
      routes: [spot]
      backoff_base_sec: 1
  max_spend_per_hour: 1.00
"""


async def fleet_scene(http: aiohttp.ClientSession, say: Callable[[str], None], st: Style, server: Server,
                      market: FakeProvider, gw: str, hdr: dict[str, str]) -> bool:
    """A pool of 2 rented spot GPUs; one is reclaimed mid-burst; a replacement is rented and
    serves, and nothing is lost. True when all of that held."""
    say("")
    say(st.bold("6) Self-healing fleet: a pool of 2 rented spot GPUs, one reclaimed mid-burst"))
    rt = server.rt
    if not await _until(lambda: len(rt.pool_nodes) == 2, 30):
        say(st.red("   the pool never filled"))
        return False
    say(f"   rented {', '.join(sorted(rt.pool_nodes))} at "
        f"${sum(p.price_per_hour for p in rt.pool_nodes.values()):.2f}/h (cap $1.00/h)")
    burst = [asyncio.create_task(fire(http, gw + "/spot/generate", hdr, i)) for i in range(BURST)]
    await asyncio.sleep(STEPS * STEP_MS / 1000 * 1.5)
    victim = market.live()[0]
    lost = f"{FLEET_POOL}-{victim.id}"
    await market.reclaim(victim)
    say(f"   {st.yellow(f'⚡ {lost} reclaimed by the host')} with "
        f"{sum(1 for t in burst if not t.done())} requests unfinished")
    res = await asyncio.gather(*burst)
    healed = await _until(lambda: len(rt.pool_nodes) == 2 and lost not in rt.pool_nodes, 30)
    s = summary(res)
    say(f"   {bar(res, st)}")
    ok = s.get("200") == BURST and healed and len(market.live()) == 2
    verdict = (st.green(f"nothing lost: {s.get('200', 0)}/{BURST} served") if s.get("200") == BURST
               else st.red(f"lost some: {s}"))
    say(f"   {verdict}; serving now: {', '.join(sorted(rt.pool_nodes))}; instances rented in all: "
        f"{len(market.instances)}, live: {len(market.live())}, spend ${market.spend_per_hour():.2f}/h")
    return ok


async def _until(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.05)
    return True
