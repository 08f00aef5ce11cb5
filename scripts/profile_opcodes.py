#!/usr/bin/env python3
"""Python bytecodes executed per request, by function: a deterministic profile of the hot path.

Wall-clock profilers on a shared 2-core box move by tens of percent between runs, and cProfile's
own overhead is larger than most of the functions it times. Counting the bytecodes each code
object executes (``sys.settrace`` with ``f_trace_opcodes``) gives the same numbers on every run,
and they follow callgrind's instructions per request (``bench_callgrind.py``) closely: they are
where to look, callgrind is the verdict.

The gateway runs in front of nginx ``return 200``; after a warm-up, tracing is switched on with
SIGUSR1 for N requests (keep-alive, 8 at a time), then off again, and the counts are written out.
With ``--tokens STREAMS`` it runs ``bench_tokens.py``'s load instead (an ``openai`` route, that
many concurrent SSE streams of ``--chunks`` chunks from its node) and counts per relayed chunk.

    python scripts/profile_opcodes.py [--requests 400] [--out now.json] [--compare before.json]
                                      [--python .venv/bin/python] [--top 40] [--by function|module]
    python scripts/profile_opcodes.py --tokens 50 --chunks 100 [--gap-ms 5] [--out ...] [--compare ...]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_tokens
import benchlib as bl

# Run inside the gateway's process (python -c): counts per code object while SIGUSR1 has it on.
TRACER = r"""
import collections, json, os, runpy, signal, sys, threading
ops, calls, on = collections.Counter(), collections.Counter(), [False]
def local(frame, event, arg):
    if event == "opcode":
        ops[frame.f_code] += 1
    return local
def start(frame, event, arg):
    frame.f_trace_opcodes = True
    calls[frame.f_code] += 1
    return local
def toggle(*_):
    on[0] = not on[0]
    if on[0]:
        ops.clear(); calls.clear()
    sys.settrace(start if on[0] else None); threading.settrace(start if on[0] else None)
    if not on[0]:
        out = {f"{c.co_filename}:{c.co_firstlineno}:{c.co_name}": [n, calls.get(c, 0)] for c, n in ops.items()}
        with open(os.environ["KL_OPCODES_OUT"], "w") as f:
            json.dump(out, f)
signal.signal(signal.SIGUSR1, toggle)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def short(filename: str) -> str:
    """kilolined/edge/app.py, aiohttp/web_protocol.py, asyncio/tasks.py: the package-relative path."""
    parts = Path(filename).parts
    for anchor in ("kilolined", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i:] if anchor == "kilolined" else parts[i + 1:])
    return "/".join(parts[-2:])


def per_request(raw: dict[str, list[int]], n: int, by: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for key, (ops, calls) in raw.items():
        filename, _line, name = key.rsplit(":", 2)
        k = short(filename) if by == "module" else f"{short(filename)}:{name}"
        out[k][0] += ops / n
        out[k][1] += calls / n
    return out


def measure(python: str, n: int, out: Path, tokens: tuple[int, int, float] | None = None) -> dict[str, list[int]]:
    """Counts over ``n`` requests, or (``tokens``: streams, chunks, gap in s) over one token load."""
    with bl.workdir("opcodes") as wd, bl.Procs(wd) as procs:
        origin = bl.free_port()
        port = bl.free_port()
        if tokens is None:
            bl.start_nginx_origin(procs, origin)
            cfg = bl.gateway_config(port, {"gpu": f"http://127.0.0.1:{origin}"})
        else:
            _, chunks, gap = tokens
            node = procs.start([bl.PYTHON, str(Path(__file__).with_name("bench_tokens.py")), "--serve-node",
                                str(origin), "--chunks", str(chunks), "--gap-ms", str(gap * 1000)], "node")
            bl.wait_port(origin, proc=node)
            cfg = bl.gateway_config(port, {"gpu": f"http://127.0.0.1:{origin}"}, bench_tokens.ROUTES)
        path = wd / "gateway.yaml"
        bl.write_yaml(path, cfg)
        kilolined = str(Path(python).parent / "kilolined")
        env = dict(os.environ, KL_OPCODES_OUT=str(out))
        with open(wd / "gateway.log", "wb") as log:
            p = subprocess.Popen([python, "-c", TRACER, kilolined, "--log-format", "text", "run", "-c", str(path)],
                                 stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            bl.wait_port(port, timeout=60, proc=p)
            if tokens is None:
                url = f"http://127.0.0.1:{port}/gen/generate"
                asyncio.run(bl.post_keepalive(url, 100))  # warm-up: first-use caches are not the hot path
                p.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
                asyncio.run(bl.post_keepalive(url, n))
            else:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                asyncio.run(bench_tokens.load(url, 4))
                p.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
                got = asyncio.run(bench_tokens.load(url, tokens[0]))
                assert got >= n, (got, n)
            p.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 60
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
        return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--python", default=sys.executable, help="the venv whose kilolined is measured")
    ap.add_argument("--out", default="opcodes.json", help="where the raw counts go (for --compare later)")
    ap.add_argument("--compare", help="an --out file of another run (same --requests) to show the difference to")
    ap.add_argument("--by", choices=("function", "module"), default="function")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--tokens", type=int, metavar="STREAMS",
                    help="count per relayed SSE chunk over this many concurrent token streams (bench_tokens.py)")
    ap.add_argument("--chunks", type=int, default=100, help="chunks per stream, with --tokens")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="the node's gap between chunks, with --tokens")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.unlink(missing_ok=True)
    tokens = (args.tokens, args.chunks, args.gap_ms / 1000) if args.tokens else None
    n = args.tokens * args.chunks if args.tokens else args.requests  # what the counts are divided by
    now = per_request(measure(args.python, n, out, tokens), n, args.by)
    before = per_request(json.loads(Path(args.compare).read_text()), n, args.by) if args.compare else {}
    zero = [0.0, 0.0]
    total_now = sum(v[0] for v in now.values())
    total_before = sum(v[0] for v in before.values())
    unit = "chunk" if args.tokens else "request"
    print(f"bytecodes per {unit}: {total_now:,.0f}" + (f" (compared: {total_before:,.0f})" if before else ""))
    keys = sorted(set(now) | set(before),
                  key=lambda k: -abs(now.get(k, zero)[0] - before.get(k, zero)[0]) if before else -now[k][0])
    rows: list[list[Any]] = []
    for k in keys[: args.top]:
        a, b = before.get(k, zero), now.get(k, zero)
        rows.append([k, round(b[0], 1), round(b[1], 2)] + ([round(a[0], 1), round(b[0] - a[0], 1)] if before else []))
    head = ["code", f"ops/{unit[:5]}", f"calls/{unit[:5]}"] + (["compared", "diff"] if before else [])
    bl.print_table(head, rows, nd=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
