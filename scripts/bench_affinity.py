#!/usr/bin/env python3
"""Prefix affinity against least-loaded and round-robin (SPEC §13 targets), on llama.cpp servers or the
simulated GPU, in one run.

Three nodes with two slots each (`llama-server -np 2 -no-kvu --cache-ram 64`: a node cannot hold
every document, and two slots never share one saved prompt), three concurrent clients (so a choice
exists), streaming chat requests through an in-process gateway. Workloads:

- **docs**: 8–16 distinct documents of 2–4 KB, Zipf popularity, a short random question each;
- **sessions**: multi-turn conversations, each turn the whole history plus a new question;
- **hot**: one 3 KB prefix in 90 % of the requests, the rest distinct documents.

Legs, each on fresh servers (empty caches) with the same requests per client:
- **rr**: round-robin, one gateway route per node, the client cycles over them;
- **least**: one route over the three nodes, `affinity: off` (least-loaded);
- **prefix**: the same route with `affinity: prefix`.

Per leg: TTFT p50/p95/p99 (client side, to the first content chunk), the cached share of prompt
tokens as the servers report it (`timings.cache_n / (cache_n + prompt_n)`), output tokens/s, the
peak in-flight of each node (polled: llama.cpp `GET /slots` `is_processing`, the fake's
`running`; and the fake's exact `max_concurrent`), requests per node (`?`: a stream that had to queue
got its 200 before a node was chosen, so no `X-KiloLine-Node` header names it). `--rounds R` runs
every leg R times in A-B-C, C-B-A order and pools the requests, so a machine whose load drifts
during the run does not favour one leg.

    # against llama.cpp (not CI): a llama-server binary (docs/BACKENDS.md builds one) and a GGUF;
    # --write-model makes one (it needs `.venv/bin/pip install gguf numpy`, nothing else does)
    .venv/bin/python scripts/bench_affinity.py --write-model $REAL_DIR/bench.gguf \\
        --vocab-from /path/to/llama.cpp/models/ggml-vocab-llama-spm.gguf
    .venv/bin/python scripts/bench_affinity.py --llama-server /path/to/llama-server \\
        --model $REAL_DIR/bench.gguf [--requests 72] [--rounds 2] [--workloads docs,sessions,hot] [--json out.json]
    # against the simulated GPU (what tests/test_affinity_bench.py runs, smaller)
    .venv/bin/python scripts/bench_affinity.py --fake [--requests 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import benchlib as bl
import yaml

from kilolined.core.config import ConfigError, parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU

KEY = "kl_bench_affinity_key_000000000000000"
NODES = 3
SLOTS = 2  # per node: llama-server -np 2, the route's max_concurrency
CLIENTS = 3
LEGS = ("rr", "least", "prefix")
WORKLOADS = ("docs", "sessions", "hot")
MODEL = "bench"
_VOCAB_TEXT = ("the of and to in is was for on that with as by at from his her an were are which this be has had it "
               "not but they have one been their also its new other after first two who more into time when year "
               "city river house music water light paper story field market school power state world night voice "
               "garden letter window silver winter summer valley forest island engine signal bridge harbor "
               "station village mountain table number system figure record season member history process")
VOCAB = tuple(_VOCAB_TEXT.split())
QUESTIONS = ("what is said about", "who mentions", "where is the", "why does the", "how many times is",
             "when was the", "which part names the", "summarise the line on")


# --------------------------------------------------------------------------- the workloads (pure, seeded)


@dataclass
class Turn:
    """One request a client sends: a fresh prompt, or the next turn of one of its sessions."""

    messages: list[dict[str, str]]
    session: int | None = None  # the client's session this turn continues (its history is prepended)


def words(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(VOCAB)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def question(rng: random.Random) -> str:
    return f"Question: {rng.choice(QUESTIONS)} {rng.choice(VOCAB)} {rng.choice(VOCAB)}?"


def zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1 / (i + 1) ** s for i in range(n)]


def docs_workload(rng: random.Random, requests: int, n_docs: int = 12) -> list[list[Turn]]:
    docs = [f"Document {i}. " + words(rng, rng.randint(2048, 4096)) for i in range(n_docs)]
    weights = zipf_weights(n_docs)
    picks = rng.choices(range(n_docs), weights=weights, k=requests)
    turns = [Turn([{"role": "system", "content": "Answer from the document."},
                   {"role": "user", "content": f"{docs[d]}\n\n{question(rng)}"}]) for d in picks]
    return deal(turns)


def sessions_workload(rng: random.Random, requests: int, per_client: int = 3) -> list[list[Turn]]:
    """Each client holds `per_client` conversations and takes them in turn, one turn at a time:
    a conversation's prefix grows by the reply and a new question every turn."""
    out: list[list[Turn]] = []
    for c in range(CLIENTS):
        turns: list[Turn] = []
        for i in range(-(-requests // CLIENTS)):
            s = i % per_client
            if i < per_client:
                intro = f"Conversation {c}.{s}. Notes: " + words(rng, rng.randint(1024, 2048))
                msgs = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": f"{intro}\n\n{question(rng)}"}]
            else:
                msgs = [{"role": "user", "content": f"{words(rng, 120)} {question(rng)}"}]
            turns.append(Turn(msgs, session=s))
        out.append(turns)
    return trim(out, requests)


def hot_workload(rng: random.Random, requests: int, hot_share: float = 0.9) -> list[list[Turn]]:
    hot = "Shared instructions. " + words(rng, 3072)
    turns = []
    for i in range(requests):
        doc = hot if rng.random() < hot_share else f"Document cold-{i}. " + words(rng, rng.randint(2048, 4096))
        turns.append(Turn([{"role": "system", "content": "Answer from the document."},
                           {"role": "user", "content": f"{doc}\n\n{question(rng)}"}]))
    return deal(turns)


def deal(turns: list[Turn]) -> list[list[Turn]]:
    return [turns[c::CLIENTS] for c in range(CLIENTS)]


def trim(per_client: list[list[Turn]], requests: int) -> list[list[Turn]]:
    """At most `requests` in all, dealt as evenly as possible."""
    counts = [requests // CLIENTS + (1 if c < requests % CLIENTS else 0) for c in range(CLIENTS)]
    return [turns[:n] for turns, n in zip(per_client, counts, strict=True)]


def make_workload(name: str, seed: int, requests: int) -> list[list[Turn]]:
    rng = random.Random(f"{name}:{seed}")
    return {"docs": docs_workload, "sessions": sessions_workload, "hot": hot_workload}[name](rng, requests)


# --------------------------------------------------------------------------- the gateway


def gateway_config(urls: list[str], leg: str, block_bytes: int) -> dict[str, Any]:
    route = {"kind": "openai", "max_concurrency": SLOTS, "max_queue_depth": 10_000, "queue_timeout_sec": 600,
             "request_timeout_sec": 600, "retry_on_failover": 0}
    names = [f"n{i}" for i in range(len(urls))]
    if leg == "rr":
        # One route per node: the client picks the node, in turn; the gateway still holds N per node.
        routes = {f"rr{i}": {**route, "path": f"/rr{i}", "strip_path": True, "nodes": [n]}
                  for i, n in enumerate(names)}
    else:
        extra = {"affinity": "prefix", "affinity_block_bytes": block_bytes} if leg == "prefix" else {}
        routes = {"llm": {**route, "path": "/v1", "nodes": names, **extra}}
    return {
        "server": {"listen": "127.0.0.1:0", "access_log": False, "shutdown_grace_sec": 0.5},
        "keys": {"bench": {"key_sha256": hashlib.sha256(KEY.encode()).hexdigest()}},
        "nodes": {n: {"url": u, "health": {"path": "/health", "interval_sec": 1}} for n, u in zip(names, urls,
                                                                                                     strict=True)},
        "routes": routes,
    }


def leg_supported(leg: str) -> str | None:
    """None, or why this gateway cannot run the leg (a gateway without the `affinity` key)."""
    try:
        parse_config(yaml.safe_dump(gateway_config(["http://127.0.0.1:1"], leg, 256)), env={})
    except ConfigError as e:
        return "; ".join(e.errors)
    return None


@contextlib.asynccontextmanager
async def gateway(urls: list[str], leg: str, block_bytes: int) -> AsyncIterator[Server]:
    text = yaml.safe_dump(gateway_config(urls, leg, block_bytes))
    server = Server(parse_config(text, env={}), hashlib.sha256(text.encode()).hexdigest(), None)
    try:
        await server.start()
        yield server
    finally:
        await server.shutdown()


# --------------------------------------------------------------------------- the nodes


class Nodes:
    """Three fresh servers for one leg, and their in-flight as the servers see it."""

    urls: list[str]

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def in_flight(self, http: aiohttp.ClientSession) -> list[int]:
        raise NotImplementedError

    def exact_peaks(self) -> list[int] | None:
        return None


@dataclass
class FakeNodes(Nodes):
    """The simulated GPU with its prompt cache (docs/BACKENDS.md), in this process."""

    prefill_ms_per_1k: float
    step_ms: float
    cache_tokens: int
    gpus: list[FakeGPU] = field(default_factory=list)

    async def start(self) -> None:
        self.gpus = [FakeGPU("openai", step_ms=self.step_ms, ctx_size=1_000_000, job_vram_gb=1, steps=8,
                             prefill_ms_per_1k=self.prefill_ms_per_1k, prompt_cache_tokens=self.cache_tokens)
                     for _ in range(NODES)]
        for gpu in self.gpus:
            await gpu.start()
        self.urls = [gpu.url for gpu in self.gpus]

    async def stop(self) -> None:
        for gpu in self.gpus:
            await gpu.stop()

    async def in_flight(self, http: aiohttp.ClientSession) -> list[int]:
        return [int(gpu.stats["running"]) for gpu in self.gpus]

    def exact_peaks(self) -> list[int]:
        return [int(gpu.stats["max_concurrent"]) for gpu in self.gpus]


@dataclass
class LlamaNodes(Nodes):
    """Three `llama-server` processes on loopback, started fresh for each leg."""

    binary: str
    model: str
    ctx: int
    threads: int
    cache_ram_mib: int
    procs: bl.Procs | None = None
    workdir: Path | None = None

    async def start(self) -> None:
        assert self.procs is not None
        ports = [bl.free_port() for _ in range(NODES)]
        for port in ports:
            cmd = [self.binary, "-m", self.model, "--alias", MODEL, "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(SLOTS), "-no-kvu", "--cache-ram", str(self.cache_ram_mib), "-c", str(self.ctx),
                   "-t", str(self.threads), "-tb", str(self.threads), "--no-warmup"]
            self.procs.start(cmd, f"llama-{port}")
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with aiohttp.ClientSession() as http:
            for url in self.urls:
                await wait_healthy(http, url)

    async def stop(self) -> None:
        assert self.procs is not None
        for p in list(self.procs.procs):
            self.procs.stop(p)

    async def in_flight(self, http: aiohttp.ClientSession) -> list[int]:
        return list(await asyncio.gather(*[processing(http, url) for url in self.urls]))


async def wait_healthy(http: aiohttp.ClientSession, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


async def processing(http: aiohttp.ClientSession, url: str) -> int:
    """Slots busy now, from llama-server's `GET /slots` (-1 when it did not answer)."""
    try:
        async with http.get(url + "/slots") as r:
            slots = await r.json()
    except (aiohttp.ClientError, OSError, ValueError):
        return -1
    return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))


# --------------------------------------------------------------------------- clients and one leg


@dataclass
class Result:
    ttft: float
    cache_n: int
    prompt_n: int
    completion: int
    node: str
    status: int


@dataclass
class Client:
    """One closed-loop client: sends its turns one after the other, keeps its sessions' history."""

    index: int
    turns: list[Turn]
    target: Callable[[int], str]  # the URL of its k-th request
    max_tokens: int
    think_ms: float  # a pause of up to this long before each request (seeded: the same in every leg)
    history: dict[int, list[dict[str, str]]] = field(default_factory=dict)

    async def run(self, http: aiohttp.ClientSession, results: list[Result]) -> None:
        # Without a pause, closed-loop clients as many as the nodes lock step: each one's next
        # request finds only the node it just left idle, and least-loaded looks sticky.
        rng = random.Random(self.index)
        for k, turn in enumerate(self.turns):
            await asyncio.sleep(rng.uniform(0, self.think_ms) / 1000)
            past = self.history.get(turn.session, []) if turn.session is not None else []
            messages = past + turn.messages
            res, reply = await one_request(http, self.target(k), messages, self.max_tokens)
            results.append(res)
            if turn.session is not None:
                self.history[turn.session] = [*messages, {"role": "assistant", "content": reply}]


async def one_request(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                      max_tokens: int) -> tuple[Result, str]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    t0 = time.monotonic()
    ttft = float("nan")
    reply: list[str] = []
    timings: dict[str, Any] = {}
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        node = r.headers.get("X-KiloLine-Node", "?")
        async for line in r.content:
            text = line.decode(errors="replace").strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not reply:
                        ttft = time.monotonic() - t0
                    reply.append(piece)
            if isinstance(event.get("timings"), dict):
                timings = event["timings"]
        status = r.status
    return Result(ttft, int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0)),
                  int(timings.get("predicted_n", 0)), node, status), "".join(reply)


async def poll_in_flight(nodes: Nodes, http: aiohttp.ClientSession, peaks: list[int], stop: asyncio.Event,
                         every: float) -> None:
    while not stop.is_set():
        for i, n in enumerate(await nodes.in_flight(http)):
            peaks[i] = max(peaks[i], n)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def run_leg(nodes: Nodes, leg: str, workload: list[list[Turn]], args: argparse.Namespace) -> dict[str, Any]:
    await nodes.start()
    try:
        async with gateway(nodes.urls, leg, args.block_bytes) as server, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=900)) as http:
            base = f"http://127.0.0.1:{server.port}"
            turn_no = [0]

            def target_for(c: int) -> Callable[[int], str]:
                if leg != "rr":
                    return lambda k: f"{base}/v1/chat/completions"

                def rr(k: int) -> str:  # one shared counter: requests go to n0, n1, n2, n0, …
                    turn_no[0] += 1
                    return f"{base}/rr{turn_no[0] % NODES}/v1/chat/completions"
                return rr

            clients = [Client(c, turns, target_for(c), args.max_tokens, args.think_ms)
                       for c, turns in enumerate(workload)]
            results: list[Result] = []
            peaks = [0] * NODES
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_in_flight(nodes, http, peaks, stop, args.poll_sec))
            t0 = time.monotonic()
            try:
                await asyncio.gather(*[c.run(http, results) for c in clients])
            finally:
                took = time.monotonic() - t0
                stop.set()
                await poller
            exact = nodes.exact_peaks()
            return {"results": results, "seconds": took, "peaks": exact or peaks,
                    "affinity": {o: n for (_, o), n in server.rt.scheduler.affinity_decisions.items()},
                    "mispredictions": server.rt.metrics.mispredictions.total()}
    finally:
        await nodes.stop()


def pooled(leg: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One leg's rounds as one result: requests pooled, peaks the highest, decisions summed."""
    results = [r for run in runs for r in run["results"]]
    peaks = [max(p) for p in zip(*(run["peaks"] for run in runs), strict=True)]
    out = summarize(leg, results, sum(run["seconds"] for run in runs), peaks)
    decisions: dict[str, int] = {}
    for run in runs:
        for o, n in run["affinity"].items():
            decisions[o] = decisions.get(o, 0) + n
    out["affinity"] = decisions
    out["mispredictions"] = sum(run["mispredictions"] for run in runs)
    out["rounds"] = len(runs)
    return out


def summarize(leg: str, results: list[Result], took: float, peaks: list[int]) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft == r.ttft]
    cached = sum(r.cache_n for r in ok)
    prompt = cached + sum(r.prompt_n for r in ok)
    per_node: dict[str, int] = {}
    for r in ok:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    return {
        "leg": leg, "requests": len(results), "ok": len(ok),
        "ttft_p50_ms": bl.percentile(ttfts, 50), "ttft_p95_ms": bl.percentile(ttfts, 95),
        "ttft_p99_ms": bl.percentile(ttfts, 99),
        "cached_share": cached / prompt if prompt else 0.0, "prompt_tokens": prompt,
        "output_tok_s": sum(r.completion for r in ok) / took if took > 0 else 0.0, "seconds": took,
        "peak_in_flight": peaks, "per_node": dict(sorted(per_node.items())),
    }


def verdicts(name: str, legs: dict[str, dict[str, Any]]) -> list[str]:
    """The SPEC §13 targets, each as one line: PASS/MISS and the numbers."""
    out = [f"{leg}: peak in-flight {r['peak_in_flight']} {'<=' if max(r['peak_in_flight']) <= SLOTS else '>'} "
           f"{SLOTS} slots" for leg, r in legs.items()]
    least, prefix = legs.get("least"), legs.get("prefix")
    if least is None or prefix is None or not least["ttft_p50_ms"] or not prefix["ttft_p50_ms"]:
        return out
    if name in ("docs", "sessions"):
        gain = (prefix["cached_share"] - least["cached_share"]) * 100
        ratio = prefix["ttft_p50_ms"] / least["ttft_p50_ms"]
        out.append(f"cached share +{gain:.1f} points (target >= +12): {'PASS' if gain >= 12 else 'MISS'}")
        out.append(f"TTFT p50 {ratio:.2f}x least-loaded (target <= 0.9x): {'PASS' if ratio <= 0.9 else 'MISS'}")
    else:
        ratio = prefix["ttft_p99_ms"] / least["ttft_p99_ms"]
        out.append(f"TTFT p99 {ratio:.2f}x least-loaded (target <= 1.1x): {'PASS' if ratio <= 1.1 else 'MISS'}")
    return out


def print_workload(name: str, legs: dict[str, dict[str, Any]]) -> None:
    print(f"\n### {name}\n")
    bl.print_table(["leg", "ok", "TTFT p50 ms", "p95", "p99", "cached share", "output tok/s",
                    "peak in-flight per node", "requests per node"],
                   [[r["leg"], f"{r['ok']}/{r['requests']}", r["ttft_p50_ms"], r["ttft_p95_ms"], r["ttft_p99_ms"],
                     f"{r['cached_share'] * 100:.1f} %", r["output_tok_s"],
                     "/".join(map(str, r["peak_in_flight"])),
                     " ".join(f"{n}:{c}" for n, c in r["per_node"].items())]
                    for r in legs.values()], nd=1)
    for line in verdicts(name, legs):
        print(f"- {line}")
    for r in legs.values():
        if r.get("affinity"):
            print(f"- {r['leg']}: affinity decisions {r['affinity']}, mispredictions {r['mispredictions']:g}")


# --------------------------------------------------------------------------- main


def make_nodes(args: argparse.Namespace, procs: bl.Procs | None) -> Nodes:
    if args.fake:
        return FakeNodes(args.prefill_ms_per_1k, args.step_ms, args.fake_cache_tokens)
    return LlamaNodes(args.llama_server, args.model, args.ctx, args.threads, args.cache_ram, procs)


async def run(args: argparse.Namespace, procs: bl.Procs | None) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": "fake" if args.fake else "llama.cpp", "args": {
        k: v for k, v in vars(args).items() if k not in ("json",)}, "workloads": {}}
    for name in args.workloads.split(","):
        workload = make_workload(name, args.seed, args.requests)
        order = []
        for leg in args.legs.split(","):
            why = leg_supported(leg)
            if why is not None:
                print(f"({name}/{leg} skipped: this gateway does not take it: {why})", file=sys.stderr)
                continue
            order.append(leg)
        runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in order}
        for k in range(args.rounds):
            # A, B, C then C, B, A: a load that drifts during the run weighs on every leg alike.
            for leg in order if k % 2 == 0 else order[::-1]:
                runs[leg].append(await run_leg(make_nodes(args, procs), leg, workload, args))
                print(f"({name}/{leg} round {k + 1} done in {runs[leg][-1]['seconds']:.1f}s)",
                      file=sys.stderr, flush=True)
        legs = {leg: pooled(leg, runs[leg]) for leg in order}
        print_workload(name, legs)
        out["workloads"][name] = {"legs": legs, "verdicts": verdicts(name, legs)}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake", action="store_true", help="the simulated GPU instead of llama-server")
    p.add_argument("--llama-server", help="the llama-server binary")
    p.add_argument("--model", help="the GGUF the servers load")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server -c (split over its 2 slots)")
    p.add_argument("--threads", type=int, default=1, help="llama-server -t and -tb")
    p.add_argument("--cache-ram", type=int, default=64, help="llama-server --cache-ram, MiB")
    p.add_argument("--requests", type=int, default=36, help="requests per workload and leg")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--legs", default=",".join(LEGS))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--think-ms", type=float, help="a client's pause before each request: uniform in [0, this] "
                                                  "(default 300; --fake 60)")
    p.add_argument("--block-bytes", type=int, default=256, help="affinity_block_bytes of the prefix leg")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every leg this many times, in A-B-C then C-B-A order, and pool the requests")
    p.add_argument("--poll-sec", type=float, default=0.02, help="in-flight polling period")
    p.add_argument("--prefill-ms-per-1k", type=float, default=300, help="--fake: prefill cost per 1000 tokens")
    p.add_argument("--step-ms", type=float, default=5, help="--fake: per output token")
    p.add_argument("--fake-cache-tokens", type=int, default=1600,
                   help="--fake: each node's prompt cache (about three documents, as --cache-ram 64 holds)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-model", metavar="OUT", help="write the bench GGUF (needs gguf, numpy) and exit")
    p.add_argument("--vocab-from", help="with --write-model: a GGUF whose llama vocabulary is copied")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--ff", type=int, default=1024)
    args = p.parse_args(argv)
    if args.write_model is None and not args.fake and not (args.llama_server and args.model):
        p.error("give --fake, or --llama-server and --model (or --write-model)")
    if args.think_ms is None:
        args.think_ms = 60 if args.fake else 300
    unknown = set(args.workloads.split(",")) - set(WORKLOADS) | set(args.legs.split(",")) - set(LEGS)
    if unknown:
        p.error(f"unknown workloads or legs: {sorted(unknown)}")
    return args


def write_model(out: str, vocab_from: str, dim: int, n_layer: int, ff: int, n_ctx: int) -> None:
    """A random-weight llama GGUF carrying a real vocabulary (llama.cpp's vocab-only GGUF), sized so
    that a 3 KB prompt costs about a second of prefill on one CPU thread."""
    import gguf  # only this step needs it (`pip install gguf numpy` in a separate venv)
    import numpy as np

    src = gguf.GGUFReader(vocab_from)

    def field_of(name: str) -> Any:
        return src.fields[name].contents()

    tokens = field_of("tokenizer.ggml.tokens")
    n_vocab, n_head = len(tokens), max(1, dim // 64)
    rng = np.random.default_rng(0)

    def rnd(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w = gguf.GGUFWriter(out, arch="llama")
    w.add_name("kiloline-bench-random")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(dim // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(field_of("tokenizer.ggml.scores"))
    w.add_token_types(field_of("tokenizer.ggml.token_type"))
    w.add_bos_token_id(int(field_of("tokenizer.ggml.bos_token_id")))
    w.add_eos_token_id(int(field_of("tokenizer.ggml.eos_token_id")))
    w.add_unk_token_id(int(field_of("tokenizer.ggml.unknown_token_id")))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    w.add_tensor("token_embd.weight", rnd(n_vocab, dim))
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    w.add_tensor("output.weight", rnd(n_vocab, dim))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + t + ".weight", rnd(dim, dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", rnd(ff, dim))
        w.add_tensor(p + "ffn_up.weight", rnd(ff, dim))
        w.add_tensor(p + "ffn_down.weight", rnd(dim, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: llama, {n_layer} layers, dim {dim}, ffn {ff}, vocab {n_vocab}, context {n_ctx}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_model:
        if not args.vocab_from:
            print("--write-model needs --vocab-from", file=sys.stderr)
            return 2
        write_model(args.write_model, args.vocab_from, args.dim, args.layers, args.ff, args.ctx)
        return 0
    bl.install_sigterm_exit()
    machine = bl.print_machine() if not args.fake else bl.machine_info()
    if args.fake:
        result = asyncio.run(run(args, None))
    else:
        version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True).stderr.strip()
        print(f"llama-server: {version.splitlines()[-1] if version else '?'}")
        with bl.workdir("affinity") as d, bl.Procs(d) as procs:
            result = asyncio.run(run(args, procs))
    result["machine"] = machine
    bl.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
