#!/usr/bin/env python3
"""Streams that survive their node, against real llama.cpp servers (docs/API.md "Streams that
survive their node"; SPEC §20's "what it must deliver").

Starts ``--nodes`` llama-servers (one slot each, greedy sampling asked per request) behind an
in-process gateway (one route, ``max_concurrency: 1`` per node, ``continue_streams`` on), then runs
``--streams`` chat streams and ``--jobs`` sse jobs, ``--clients`` at a time. Each one's node is
killed (SIGKILL: a spot GPU reclaimed) at a random point after at least ``--min-chunks`` content
chunks, and started again at once on the same port. For every stream it checks:

- *not cut*: it ends with ``[DONE]`` and no error;
- *seam*: the chunks before the seam are, token by token, the uninterrupted answer's first ones
  (asked of a node directly, before the run), and the text after it is exactly what a node
  continues from that text (the same continuation body, asked directly): nothing repeated or
  dropped;
- *whole*: the client's text equals the uninterrupted answer (greedy decoding makes it so unless
  the server tokenizes the text so far differently from how it generated it);
- *usage*: ``completion_tokens`` equals the content chunks the client received;
- *one stream*: one ``id``, ``model`` and ``created``;
- and, throughout, no node runs more than its one slot (``GET /slots`` polled every 10 ms).

Sse jobs are checked for completion with the whole text. ``continue_streams: false`` is run for
``--off`` streams, which must end with the error, as before. ``--messages`` streams are Anthropic's
(``/v1/messages``), checked as the chat streams are, in their shapes: one ``message_start`` and one
text block, ``output_tokens`` equal to the text deltas received, the seam against what a node
continues when asked directly with the text so far as a prefilled assistant message.

    .venv/bin/python scripts/bench_continue.py --llama-server $REAL_DIR/llama/.../bin/llama-server \\
        --model $REAL_DIR/llama/tiny.gguf [--streams 50 --jobs 10 --off 5 --nodes 3]

A GBNF grammar (``root ::= [ -~]+``, any printable text: a continuation is as free as the
uninterrupted answer) slows the tiny model to a few ms per token, so that a kill lands mid-answer.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kilolined.core.config import parse_config
from kilolined.edge.server import Server

KEY = "kl-bench-continue"
ADMIN = "kl-bench-admin"
GRAMMAR = "root ::= [ -~]+"
WORDS = ("river", "lantern", "harbor", "copper", "meadow", "signal", "orbit", "cedar", "violet", "engine")


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


class Node:
    """One llama-server on a fixed port, killed and started again."""

    def __init__(self, name: str, port: int, a: argparse.Namespace, logdir: Path):
        self.name, self.port, self.a = name, port, a
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.max_busy = 0
        self.ready = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [self.a.llama_server, "-m", self.a.model, "--alias", "kiloline-tiny", "--host", "127.0.0.1",
               "--port", str(self.port), "--parallel", "1", "-c", str(self.a.ctx), "--threads", "1"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.kills += 1

    async def up(self, http: aiohttp.ClientSession, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                async with http.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name} did not come up: see {self.log}")

    async def restart(self, http: aiohttp.ClientSession) -> None:
        self.ready = False
        self.kill()
        self.start()
        await self.up(http)
        self.ready = True


def gateway_config(nodes: list[Node], continue_streams: bool, retries: int) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "heartbeat_sec": 1, "shutdown_grace_sec": 2, "access_log": False},
        "admin": {"key_sha256": sha(ADMIN), "public_metrics": True},
        "keys": {"bench": {"key_sha256": sha(KEY), "routes": ["*"]}},
        "nodes": {n.name: {"url": n.url, "health": {"path": "/health", "interval_sec": 0.25, "timeout_sec": 1,
                                                      "fall": 1, "rise": 1},
                           "breaker": {"consecutive_failures": 100, "open_sec": 0.5, "slow_start_sec": 0}}
                  for n in nodes},
        "routes": {"llm": {"kind": "openai", "path": "/v1", "nodes": [n.name for n in nodes],
                           "max_concurrency": 1, "retry_on_failover": retries, "queue_timeout_sec": 60,
                           "request_timeout_sec": 120, "continue_streams": continue_streams}},
    }


def body(prompt: str, a: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return {"model": "kiloline-tiny", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": a.max_tokens, "temperature": 0, "seed": 1, "grammar": GRAMMAR,
            "stream_options": {"include_usage": True}, **extra}


@dataclass
class Read:
    """A stream as its client read it."""

    chunks: list[str] = field(default_factory=list)
    ids: set[tuple[Any, Any]] = field(default_factory=set)
    created: list[Any] = field(default_factory=list)  # each event's, in order
    kinds: list[bool] = field(default_factory=list)  # each event: it carried content
    comments: list[str] = field(default_factory=list)
    seam_at: list[int] = field(default_factory=list)  # content chunks before each seam comment
    usage: dict[str, Any] | None = None
    errors: list[Any] = field(default_factory=list)
    done: bool = False
    node: str = ""

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def line(self, line: str) -> None:
        if line.startswith(":"):
            self.comments.append(line)
            if line.startswith(": continued on "):
                self.seam_at.append(len(self.chunks))
        elif line == "data: [DONE]":
            self.done = True
        elif line.startswith("data:"):
            ev = json.loads(line[5:])
            if "error" in ev:
                self.errors.append(ev["error"])
                return
            self.ids.add((ev.get("id"), ev.get("model")))
            self.created.append(ev.get("created"))
            if ev.get("usage"):
                self.usage = ev["usage"]
            pieces = [(c.get("delta") or {}).get("content") for c in ev.get("choices") or []]
            self.chunks += [p for p in pieces if p]
            self.kinds.append(any(pieces))


class MessagesRead(Read):
    """An Anthropic Messages stream as its client read it (``ids`` holds each message_start's id,
    ``created`` one entry per content block start)."""

    def line(self, line: str) -> None:
        if line.startswith(":"):
            self.comments.append(line)
            if line.startswith(": continued on "):
                self.seam_at.append(len(self.chunks))
        elif line.startswith("event: error"):
            self.errors.append(line)
        elif line.startswith("data:"):
            ev = json.loads(line[5:])
            kind = ev.get("type")
            if kind == "message_start":
                self.ids.add((ev["message"].get("id"), ev["message"].get("model")))
            elif kind == "content_block_start":
                self.created.append(ev.get("index"))
            elif kind == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                self.chunks.append(ev["delta"]["text"])
            elif kind == "message_delta" and isinstance(ev.get("usage"), dict):
                self.usage = ev["usage"]
            elif kind == "message_stop":
                self.done = True
            elif "error" in ev:
                self.errors.append(ev)


def messages_body(prompt: str, a: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    # No grammar: llama.cpp's Messages endpoint drops it (asked directly, ``root ::= "x"+`` still
    # answered any text), so these answers run at the model's full speed.
    return {"model": "kiloline-tiny", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": a.max_tokens, "temperature": 0, "seed": 1, **extra}


async def direct(http: aiohttp.ClientSession, node: Node, b: dict[str, Any],
                 path: str = "/v1/chat/completions") -> Read:
    """A stream asked of a node directly (the reference)."""
    for _ in range(100):
        got = MessagesRead() if path == "/v1/messages" else Read()
        async with http.post(node.url + path, json=b) as r:
            if r.status == 503:  # its one slot is busy, or it is loading
                await asyncio.sleep(0.1)
                continue
            if r.status != 200:
                raise RuntimeError(f"{node.name}: HTTP {r.status} {await r.text()}")
            async for raw in r.content:
                got.line(raw.decode().rstrip("\r\n"))
        return got
    raise RuntimeError(f"{node.name}: busy for 10 s")


@dataclass
class Outcome:
    kind: str
    cut: bool = False
    seam_ok: bool = False
    whole_ok: bool = False
    usage_ok: bool = False
    one_id: bool = False
    seams: int = 0
    killed_at: int = 0
    note: str = ""
    #: the text differs from the uninterrupted answer from the seam's first character on
    at_seam: bool = False


class Bench:
    def __init__(self, a: argparse.Namespace, nodes: list[Node], http: aiohttp.ClientSession, gw: str):
        self.a, self.nodes, self.http, self.gw = a, nodes, http, gw
        self.by_name = {n.name: n for n in nodes}
        self.rng = random.Random(a.seed)
        self.locks = {n.name: asyncio.Lock() for n in nodes}
        self.kills = 0

    async def direct(self, b: dict[str, Any], path: str = "/v1/chat/completions") -> Read:
        """Asked of a live node directly; again elsewhere if the other client's kill takes it."""
        for _ in range(50):
            try:
                return await direct(self.http, next(n for n in self.nodes if n.ready), b, path)
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
        raise RuntimeError("no node answered the reference continuation")

    async def kill(self, name: str) -> None:
        """A spot reclaim: the node's process dies, and a fresh one takes its port."""
        self.kills += 1
        async with self.locks[name]:
            await self.by_name[name].restart(self.http)

    async def stream(self, i: int, prompt: str, ref: Read) -> Outcome:
        a = self.a
        k = self.rng.randint(a.min_chunks, max(a.min_chunks, len(ref.chunks) // 2))
        got = Read()
        killer: asyncio.Task[None] | None = None
        headers = {"Authorization": f"Bearer {KEY}"}
        async with self.http.post(self.gw + "/v1/chat/completions", json=body(prompt, a), headers=headers) as r:
            got.node = r.headers.get("X-KiloLine-Node", "")
            async for raw in r.content:
                got.line(raw.decode().rstrip("\r\n"))
                if killer is None and len(got.chunks) >= k and got.node:
                    killer = asyncio.create_task(self.kill(got.node))
        if killer is not None:
            await killer
        out = Outcome("stream", killed_at=k, seams=len(got.seam_at))
        out.cut = bool(got.errors) or not got.done
        # llama.cpp stamps each chunk with the second it was made: `created` may tick within one
        # node's stream; after the seam every chunk carries the first chunk's.
        out.one_id = len(got.ids) == 1 and all(c == got.created[0] for c in _after_seam(got))
        out.usage_ok = got.usage is not None and got.usage.get("completion_tokens") == len(got.chunks)
        out.whole_ok = got.text == ref.text
        if got.seam_at:
            s = got.seam_at[0]
            before = got.chunks[:s]
            # What a node continues from exactly that text, asked directly.
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "".join(before)}]
            cont = await self.direct(body(prompt, a, max_tokens=a.max_tokens - s, messages=messages,
                                          continue_final_message=True, add_generation_prompt=False))
            after = "".join(got.chunks[s:got.seam_at[1]] if len(got.seam_at) > 1 else got.chunks[s:])
            out.at_seam = _diverge(got.text, ref.text) == len("".join(before))
            out.seam_ok = before == ref.chunks[:s] and (after == cont.text or (len(got.seam_at) > 1
                                                                               and cont.text.startswith(after)))
        if not out.whole_ok:
            out.note = f"#{i}: diverged at char {_diverge(got.text, ref.text)} (seam at chunk {got.seam_at})"
        if not out.seam_ok or out.cut:
            out.note += f" seam_ok={out.seam_ok} cut={out.cut} errors={got.errors} seams={got.seam_at}"
        return out

    async def messages(self, i: int, prompt: str, ref: Read) -> Outcome:
        """An Anthropic Messages stream (``ref``: its uninterrupted answer from /v1/messages)."""
        a = self.a
        k = self.rng.randint(a.min_chunks, max(a.min_chunks, len(ref.chunks) // 2))
        got = MessagesRead()
        killer: asyncio.Task[None] | None = None
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        async with self.http.post(self.gw + "/v1/messages", json=messages_body(prompt, a), headers=headers) as r:
            got.node = r.headers.get("X-KiloLine-Node", "")
            async for raw in r.content:
                got.line(raw.decode().rstrip("\r\n"))
                if killer is None and len(got.chunks) >= k and got.node:
                    killer = asyncio.create_task(self.kill(got.node))
        if killer is not None:
            await killer
        out = Outcome("messages", killed_at=k, seams=len(got.seam_at))
        out.cut = bool(got.errors) or not got.done
        out.one_id = len(got.ids) == 1 and len(got.created) == 1  # one message, one text block
        out.usage_ok = got.usage is not None and got.usage.get("output_tokens") == len(got.chunks)
        out.whole_ok = got.text == ref.text
        if got.seam_at:
            s = got.seam_at[0]
            before = "".join(got.chunks[:s])
            # What a node continues from exactly that text, prefilled, asked directly (llama.cpp's
            # first delta repeats the prefill: it is not part of the continuation).
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": before}]
            cont = (await self.direct(messages_body(prompt, a, max_tokens=a.max_tokens - s, messages=messages),
                                      "/v1/messages")).text.removeprefix(before)
            after = "".join(got.chunks[s:got.seam_at[1]] if len(got.seam_at) > 1 else got.chunks[s:])
            out.at_seam = _diverge(got.text, ref.text) == len(before)
            out.seam_ok = got.chunks[:s] == ref.chunks[:s] and (after == cont or (len(got.seam_at) > 1
                                                                                 and cont.startswith(after)))
        if not out.seam_ok or out.cut or not out.usage_ok:
            tokens, ref_tokens = (got.usage or {}).get("output_tokens"), (ref.usage or {}).get("output_tokens")
            out.note = (f"messages #{i}: seam_ok={out.seam_ok} cut={out.cut} errors={got.errors} seams={got.seam_at}"
                        f" killed after {k} of {len(ref.chunks)}; output_tokens {tokens} for {len(got.chunks)}"
                        f" deltas (uninterrupted: {ref_tokens} for {len(ref.chunks)})")
        return out

    async def job(self, i: int, prompt: str, ref: Read) -> Outcome:
        a = self.a
        k = self.rng.randint(a.min_chunks, max(a.min_chunks, len(ref.chunks) // 2))
        headers = {"Authorization": f"Bearer {KEY}", "X-KiloLine-Mode": "sse"}
        node, killer, name, result_url, final, failed = "", None, "message", "", "", None
        async with self.http.post(self.gw + "/v1/chat/completions", json=body(prompt, a), headers=headers) as r:
            async for raw in r.content:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    d = json.loads(line[5:])
                    if name == "dispatched":
                        node = d["node"]
                    elif name == "step_progress" and d["step"] >= k and killer is None and node:
                        killer = asyncio.create_task(self.kill(node))
                    elif name in ("output_ready", "failed"):
                        final, result_url, failed = name, d.get("result_url", ""), d.get("error")
                        break
        if killer is not None:
            await killer
        out = Outcome("job", killed_at=k)
        out.cut = final != "output_ready"
        if out.cut:
            out.note = f"job #{i}: {final} {failed}"
        if not out.cut:
            got = Read()
            async with self.http.get(self.gw + result_url) as r:
                for line in (await r.text()).split("\n"):
                    got.line(line)
            out.seams = len(got.seam_at)
            out.whole_ok = got.text == ref.text
            out.one_id = len(got.ids) == 1 and all(c == got.created[0] for c in _after_seam(got))
            out.usage_ok = True  # the client asked for usage: it is in the result, summed
            out.seam_ok = got.chunks[:got.seam_at[0]] == ref.chunks[:got.seam_at[0]] if got.seam_at else False
        return out

    async def off(self, i: int, prompt: str, ref: Read) -> Outcome:
        """continue_streams: false (a second gateway): the stream ends with the error."""
        out = await self.stream(i, prompt, ref)
        out.kind = "off"
        return out


def _after_seam(got: Read) -> list[Any]:
    """The `created` of the events after the first seam (content events are what seam_at counts)."""
    if not got.seam_at:
        return []
    n, out = 0, []
    for c, is_content in zip(got.created, got.kinds, strict=True):
        if n >= got.seam_at[0]:
            out.append(c)
        n += is_content
    return out


def _diverge(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def poll_slots(http: aiohttp.ClientSession, nodes: list[Node], stop: asyncio.Event) -> None:
    """The most slots each node ran at once (llama.cpp's own GET /slots)."""
    while not stop.is_set():
        for n in nodes:
            try:
                async with http.get(n.url + "/slots", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        n.max_busy = max(n.max_busy, sum(1 for s in await r.json() if s.get("is_processing")))
            except (aiohttp.ClientError, TimeoutError):
                pass
        await asyncio.sleep(0.01)


async def run(a: argparse.Namespace) -> int:
    logdir = Path(tempfile.mkdtemp(prefix="kl-continue-"))
    nodes = [Node(f"n{i}", a.port + i, a, logdir) for i in range(a.nodes)]
    for n in nodes:
        n.start()
    servers: list[Server] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
            for n in nodes:
                await n.up(http)
            gws = []
            for cont in (True, False):
                text = yaml.safe_dump(gateway_config(nodes, cont, a.retries))
                path = logdir / f"kiloline-{cont}.yaml"
                path.write_text(text)
                srv = Server(parse_config(text, env={}), sha(text), str(path), watch=False)
                await srv.start()
                servers.append(srv)
                gws.append(f"http://127.0.0.1:{srv.port}")
            rng = random.Random(a.seed)
            prompts = [f"Tell me about the {' '.join(rng.sample(WORDS, 3))} number {i}."
                       for i in range(a.streams + a.jobs + a.off + a.messages)]
            chats = a.streams + a.jobs + a.off
            refs = [await direct(http, nodes[i % len(nodes)], body(p, a)) for i, p in enumerate(prompts[:chats])]
            refs += [await direct(http, nodes[i % len(nodes)], messages_body(p, a), "/v1/messages")
                     for i, p in enumerate(prompts[chats:])]
            print(f"references: {len(refs)} uninterrupted answers, {sum(len(r.chunks) for r in refs)} chunks; "
                  f"same answer from another node: {await _stable(http, nodes, prompts[0], refs[0], a)}")
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_slots(http, nodes, stop))
            on = Bench(a, nodes, http, gws[0])
            work = ([(on.stream, i) for i in range(a.streams)] + [(on.job, a.streams + i) for i in range(a.jobs)]
                    + [(on.messages, chats + i) for i in range(a.messages)])
            outcomes: list[Outcome] = []
            sem = asyncio.Semaphore(a.clients)

            async def one(fn: Any, i: int) -> None:
                async with sem:
                    outcomes.append(await fn(i, prompts[i], refs[i]))

            t0 = time.monotonic()
            await asyncio.gather(*(one(fn, i) for fn, i in work))
            off = Bench(a, nodes, http, gws[1])
            for i in range(a.streams + a.jobs, a.streams + a.jobs + a.off):
                outcomes.append(await off.off(i, prompts[i], refs[i]))
            stop.set()
            await poller
            elapsed = time.monotonic() - t0
            metric = servers[0].rt.metrics.continuations.labels("llm").value
    finally:
        for srv in servers:
            await srv.shutdown()
        for n in nodes:
            n.kill()
    report(outcomes, nodes, metric, elapsed, on.kills + off.kills, a)
    # A Messages answer (no grammar slows it) may end before its kill lands: no seam, nothing to check.
    streams = [o for o in outcomes if o.kind == "stream" or (o.kind == "messages" and o.seams)]
    cut = any(o.cut for o in outcomes if o.kind != "off")  # off: cut by design
    return 0 if streams and not cut and all(o.seam_ok for o in streams) else 1


async def _stable(http: aiohttp.ClientSession, nodes: list[Node], prompt: str, ref: Read,
                  a: argparse.Namespace) -> bool:
    return (await direct(http, nodes[-1], body(prompt, a))).text == ref.text


def report(outcomes: list[Outcome], nodes: list[Node], metric: float, elapsed: float, kills: int,
           a: argparse.Namespace) -> None:
    def row(kind: str) -> str:
        os_ = [o for o in outcomes if o.kind == kind]
        if not os_:
            return f"| {kind} | 0 | | | | | | |"
        n = len(os_)
        return (f"| {kind} | {n} | {sum(o.cut for o in os_)} | {sum(o.seams for o in os_)} | "
                f"{sum(o.seam_ok for o in os_)}/{n} | {sum(o.whole_ok for o in os_)}/{n} | "
                f"{sum(o.usage_ok for o in os_)}/{n} | {sum(o.one_id for o in os_)}/{n} |")

    print(f"\n{a.nodes} llama-servers (-np 1), max_tokens {a.max_tokens}, kill after >= {a.min_chunks} chunks, "
          f"{a.clients} clients, retry_on_failover {a.retries}; {elapsed:.1f} s\n")
    print("| what | runs | cut | seams | seam exact | = uninterrupted | usage = chunks | one id/model, created kept |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("stream", "job", "off", "messages"):
        print(row(kind))
    print(f"\nkills: {kills}; most slots busy at once per node: "
          f"{ {n.name: n.max_busy for n in nodes} }; kiloline_stream_continuations_total: {metric:g}")
    differ = [o for o in outcomes if o.kind == "stream" and o.seams and not o.whole_ok]
    print(f"streams whose text differs from the uninterrupted answer: {len(differ)}, of which from the seam's "
          f"first character on: {sum(o.at_seam for o in differ)}")
    notes = [o.note for o in outcomes if o.note and o.kind != "off" and not o.at_seam]
    if notes:
        print("notes:", *notes, sep="\n  ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--off", type=int, default=5, help="streams through a gateway with continue_streams: false")
    p.add_argument("--messages", type=int, default=0, help="Anthropic /v1/messages streams")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--min-chunks", type=int, default=10)
    p.add_argument("--retries", type=int, default=2, help="retry_on_failover")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--port", type=int, default=18180)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(run(parse_args())))
