#!/usr/bin/env python3
"""LLM token streams: the proxy's CPU per relayed SSE chunk, the gateway beside nginx.

A node written for the bench (``--serve-node``, a bare asyncio protocol: cheap, so the proxies
are what is measured) answers ``POST /v1/chat/completions`` with ``"stream": true`` as vLLM does:
one ``data: {chat.completion.chunk}`` event per token, a gap of ``--gap-ms`` between writes, a
usage chunk when ``stream_options.include_usage`` asks, then ``data: [DONE]``. N clients stream at
once through the gateway (an ``openai`` route) and then through nginx (``proxy_buffering off``),
in the same run; each proxy's CPU (utime+stime from /proc) over its phase ÷ chunks relayed.

    .venv/bin/python scripts/bench_tokens.py [--streams 200] [--chunks 200] [--gap-ms 5] [--rounds 1]

CPU time on a shared box moves with its load. ``--callgrind`` counts instead the gateway's
user-space instructions per relayed chunk, repeatable whatever the load: the gateway runs under
``valgrind --tool=callgrind``, its counters are zeroed after a warm-up (``callgrind_control -z``)
and dumped after one load of N streams; give it a gap long enough that valgrind's slowness does
not merge a stream's chunks into one read (the script reports the reads per chunk it saw).

    .venv/bin/python scripts/bench_tokens.py --callgrind --streams 20 --chunks 100 --gap-ms 100

``--alias`` (with ``--callgrind``): the client asks for a name the route maps to the node's, so
every chunk is renamed back on its way (what a model alias costs per token).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import benchlib as bl
import orjson

# --------------------------------------------------------------------------- the node


def chunk_event(i: int) -> bytes:
    ev = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "bench",
          "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


USAGE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "bench",
         "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 0}}


class NodeConn(asyncio.Protocol):
    """One keep-alive connection of the bench node; requests are read whole (head + Content-Length)."""

    def __init__(self, chunks: int, gap: float):
        self.chunks, self.gap = chunks, gap
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buf[:head_end].lower()
        length = 0
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if len(self.buf) < head_end + 4 + length:
            return
        body = self.buf[head_end + 4:head_end + 4 + length]
        self.buf = self.buf[head_end + 4 + length:]
        self.busy = True
        task = asyncio.get_running_loop().create_task(self._stream(body))
        task.add_done_callback(lambda _: None)

    async def _stream(self, body: bytes) -> None:
        tr = self.transport
        assert tr is not None
        usage = b'"include_usage":true' in body.replace(b" ", b"")
        tr.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(self.chunks):
            await asyncio.sleep(self.gap)
            if tr.is_closing():
                return
            self._write_chunk(chunk_event(i))
        if usage:
            u = dict(USAGE, usage={"prompt_tokens": 10, "completion_tokens": self.chunks,
                                   "total_tokens": 10 + self.chunks})
            self._write_chunk(b"data: " + orjson.dumps(u) + b"\n\n")
        self._write_chunk(b"data: [DONE]\n\n")
        tr.write(b"0\r\n\r\n")
        self.busy = False
        self._next()

    def _write_chunk(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))


async def serve_node(port: int, chunks: int, gap: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: NodeConn(chunks, gap), "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# --------------------------------------------------------------------------- the clients

# The gateway's route: an openai one (usage asked of the node and cut out again), the node's
# defaults (the slow-node watch, with its stall_sec, on).
ROUTES = {"llm": {"path": "/v1", "kind": "openai", "nodes": ["gpu"], "max_concurrency": 4096,
                  "max_queue_depth": 100000, "queue_timeout_sec": 600, "request_timeout_sec": 600}}


#: ``--alias``: the client asks for this name, the route maps it to the node's ("bench"), and every
#: chunk's ``model`` is given back the client's name on the way (docs/CONFIG.md#rewriting-requests)
ALIAS = "gpt-4o-mini"


def aliased(routes: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    return {n: {**r, "rewrite": {"model": {ALIAS: "bench"}}} for n, r in routes.items()}


async def one_stream(session: aiohttp.ClientSession, url: str, model: str = "bench") -> tuple[int, int]:
    """The content events one stream relayed, and the reads that brought them."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    events = reads = 0
    async with session.post(url, json=body, headers=bl.API_HDR) as r:
        assert r.status == 200, (r.status, await r.text())
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            *lines, buf = buf.split(b"\n")
            n = sum(1 for line in lines if line.startswith(b"data: {"))
            events += n
            reads += n > 0
    return events, reads


async def load(url: str, streams: int, model: str = "bench") -> int:
    conn = aiohttp.TCPConnector(limit=streams + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        got = await asyncio.gather(*(one_stream(s, url, model) for _ in range(streams)))
    events, reads = sum(g[0] for g in got), sum(g[1] for g in got)
    if streams >= 8:  # the measured loads, not the warm-ups
        print(f"  {events} events in {reads} client reads ({events / max(1, reads):.2f} per read)", flush=True)
    return events


def user_sys(pid: int) -> tuple[float, float]:
    """utime and stime of the process, in seconds."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]) / bl.CLK_TCK, int(fields[12]) / bl.CLK_TCK


def sleeps(pid: int) -> int:
    """How often the process has gone to sleep (voluntary context switches of its main thread):
    each one an epoll wait with nothing ready, and a wake-up the kernel charges to it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def measure(pid: int, url: str, streams: int, chunks: int, perf: bool = False) -> tuple[float, float, float]:
    """µs of the proxy's CPU per chunk relayed (of which in the kernel), and the phase's wall
    seconds; prints its sleeps per chunk (and, with ``perf``, its system calls per chunk)."""
    tracer = None
    if perf:
        tracer = subprocess.Popen(["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter", "-p", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
    (u0, s0), w0, t0 = user_sys(pid), sleeps(pid), time.monotonic()
    events = asyncio.run(load(url, streams))
    (u1, s1), w1, t1 = user_sys(pid), sleeps(pid), time.monotonic()
    want = streams * chunks
    if events < want:
        raise RuntimeError(f"{url}: {events} content events relayed, {want} sent")
    extra = ""
    if tracer is not None:
        tracer.send_signal(signal.SIGINT)
        _, err = tracer.communicate(timeout=30)
        calls = next((int(ln.split(",")[0]) for ln in err.splitlines() if "raw_syscalls" in ln), 0)
        extra = f", {calls / want:.2f} system calls"
    print(f"  {(w1 - w0) / want:.2f} sleeps per chunk{extra}", flush=True)
    return (u1 - u0 + s1 - s0) / want * 1e6, (s1 - s0) / want * 1e6, t1 - t0


def callgrind(wd: Path, node_port: int, streams: int, chunks: int, alias: bool = False) -> float:
    """The gateway's instructions per relayed chunk, counted by callgrind over one load."""
    port = bl.free_port()
    path = wd / "gateway-callgrind.yaml"
    routes = aliased(ROUTES) if alias else ROUTES
    model = ALIAS if alias else "bench"
    bl.write_yaml(path, bl.gateway_config(port, {"gpu": f"http://127.0.0.1:{node_port}"}, routes))
    out = wd / "callgrind-tokens.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
           bl.KILOLINED, "--log-format", "text", "run", "-c", str(path)]
    with open(wd / "gateway-callgrind.log", "wb") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        bl.wait_port(port, timeout=1800, proc=p)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(load(url, 4, model))  # warm-up: connections, imports, first-use caches
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True, timeout=600)
        events = asyncio.run(load(url, streams, model))
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True, timeout=600)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    want = streams * chunks
    if events < want:
        raise RuntimeError(f"{events} content events relayed, {want} sent")
    dumps = sorted(wd.glob(f"{out.name}.*"))
    if not dumps:
        raise RuntimeError((wd / "gateway-callgrind.log").read_text(errors="replace")[-2000:])
    text = dumps[0].read_text(errors="replace")
    m = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
    if m is None:
        raise RuntimeError(f"no totals in {dumps[0]}")
    per = int(m.group(1)) / want
    print(f"kilolined: {per:,.0f} instructions per chunk (zeroed after warm-up, {streams} streams x {chunks} "
          f"chunks; {dumps[0]})", flush=True)
    parts = split(dumps[0])
    if parts:
        print("  of which: " + "; ".join(f"{name} {n / want:,.0f}" for name, n in parts.items()), flush=True)
    return per


#: Where a chunk's instructions are spent, by the event loop's entry point (inclusive counts):
#: socket callbacks carry the relay itself (the node's read, its parse, the client's write; and
#: the requests' arrival), ready callbacks the tasks (each stream's request, start and end, and the
#: gateway's background loops: per stream and per second, not per chunk), timers the rest.
LOOP_PARTS = {"socket callbacks (the relay)": "uv__io_poll", "ready callbacks (requests, background)": "Loop__on_idle",
              "timers": "uv__run_timers"}


def split(dump: Path) -> dict[str, int]:
    """The dump's instructions under each of LOOP_PARTS (callgrind_annotate, inclusive)."""
    try:
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                              capture_output=True, text=True, timeout=600).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    parts = {}
    for name, fn in LOOP_PARTS.items():
        m = re.search(rf"^\s*([\d,]+) \(.*[:_0-9]{fn} \[", text, re.M)
        if m is not None:
            parts[name] = int(m.group(1).replace(",", ""))
    return parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--callgrind", action="store_true",
                    help="count the gateway's instructions per chunk under callgrind instead (no nginx)")
    ap.add_argument("--perf", action="store_true",
                    help="also count each proxy's system calls per chunk (perf stat, raw_syscalls tracepoint)")
    ap.add_argument("--alias", action="store_true",
                    help="with --callgrind: the client asks for an alias, every chunk is renamed back")
    ap.add_argument("--serve-node", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_node:
        asyncio.run(serve_node(args.serve_node, args.chunks, args.gap_ms / 1000))
        return 0
    bl.raise_nofile()
    bl.install_sigterm_exit()
    bl.print_machine()
    with bl.workdir("tokens") as wd, bl.Procs(wd) as procs:
        node_port, gw_port, ngx_port = bl.free_port(), bl.free_port(), bl.free_port()
        node = procs.start([bl.PYTHON, __file__, "--serve-node", str(node_port), "--chunks", str(args.chunks),
                            "--gap-ms", str(args.gap_ms)], "node", cpu=1)
        bl.wait_port(node_port, proc=node)
        if args.callgrind:
            callgrind(wd, node_port, args.streams, args.chunks, args.alias)
            return 0
        gw, _ = bl.start_gateway(procs, bl.gateway_config(gw_port, {"gpu": f"http://127.0.0.1:{node_port}"}, ROUTES),
                              cpu=0)
        ngx = bl.start_nginx(procs, ngx_port, node_port, cpu=0, buffering=False)
        targets = {"kilolined": (bl.main_pid(gw), gw_port), "nginx": (bl.main_pid(ngx), ngx_port)}
        results: dict[str, list[float]] = {k: [] for k in targets}
        for _pid, port in targets.values():  # warm-up: connections, imports, caches
            asyncio.run(load(f"http://127.0.0.1:{port}/v1/chat/completions", 4))
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                pid, port = targets[name]
                us, sys_us, wall = measure(pid, f"http://127.0.0.1:{port}/v1/chat/completions", args.streams,
                                           args.chunks, args.perf)
                results[name].append(us)
                print(f"round {r + 1} {name}: {us:.2f} µs CPU per chunk, {sys_us:.2f} of it in the kernel "
                      f"({wall:.1f} s)", flush=True)
        gw_us, ngx_us = (statistics.median(results[k]) for k in ("kilolined", "nginx"))
        bl.print_table(("proxy", "CPU µs per chunk", "÷ nginx"),
                       [("kilolined", f"{gw_us:.2f}", f"{gw_us / ngx_us:.2f}"), ("nginx", f"{ngx_us:.2f}", "1.00")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
