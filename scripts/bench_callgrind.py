#!/usr/bin/env python3
"""Instructions per request of the gateway, counted by callgrind: repeatable on a busy box.

Wall-clock and CPU-time benchmarks on a shared 2-core machine move by ±30 % between runs;
instruction counts do not (valgrind's own docs: the same binary, inputs and environment give the
same count). The gateway runs under ``valgrind --tool=callgrind`` in front of nginx `return 200`;
a client sends N1, then N2 requests (keep-alive, 8 at a time); the difference of the two totals,
divided by N2 − N1, is the cost of one request with start-up and shutdown cancelled out.

    python scripts/bench_callgrind.py [--n1 300 --n2 1300] [--python .venv/bin/python]

``--affinity off|prefix`` measures a 16 KiB OpenAI chat body instead, on an ``openai`` route at
``/v1`` over three nodes (one nginx) with that ``affinity``: the difference of the two is what the
prefix index costs per request (canonical text, 64 BLAKE2b keys, the match on each node, the record).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl
import orjson


def chat_body(size: int = 16 * 1024) -> bytes:
    """A chat request of ``size`` bytes: a long system document and a short question."""
    doc = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[: size - 200]
    return orjson.dumps({"model": "bench", "max_tokens": 8, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": "What does the fox do?"}]})


def chat_routes(affinity: str) -> dict[str, dict[str, object]]:
    return {"llm": {"path": "/v1", "kind": "openai", "nodes": ["g1", "g2", "g3"], "max_concurrency": 512,
                    "max_queue_depth": 100000, "queue_timeout_sec": 600, "request_timeout_sec": 600,
                    "affinity": affinity}}


def run_one(python: str, wd: Path, procs: bl.Procs, node_port: int, n: int, affinity: str | None = None) -> int:
    port = bl.free_port()
    node = f"http://127.0.0.1:{node_port}"
    if affinity is None:
        cfg = bl.gateway_config(port, {"gpu": node})
        url, body = f"http://127.0.0.1:{port}/gen/generate", b'{"steps": 0}'
    else:
        cfg = bl.gateway_config(port, {"g1": node, "g2": node, "g3": node}, chat_routes(affinity))
        url, body = f"http://127.0.0.1:{port}/v1/chat/completions", chat_body()
    path = wd / f"gw-{n}.yaml"
    bl.write_yaml(path, cfg)
    out = wd / f"callgrind-{n}.out"
    kilolined = str(Path(python).parent / "kilolined")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
           python, kilolined, "--log-format", "text", "run", "-c", str(path)]
    with open(wd / f"gw-{n}.log", "wb") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    bl.wait_port(port, timeout=900, proc=p)  # python under valgrind starts slowly on a busy box
    asyncio.run(bl.post_keepalive(url, 50, body=body))  # warm-up, the same in both runs
    asyncio.run(bl.post_keepalive(url, n, body=body))
    p.send_signal(signal.SIGINT)
    p.wait(timeout=300)
    text = (wd / f"gw-{n}.log").read_text(errors="replace")
    m = re.search(r"Collected : (\d+)", text)
    if m is None:
        raise RuntimeError(text[-2000:])
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n1", type=int, default=300)
    ap.add_argument("--n2", type=int, default=1300)
    ap.add_argument("--python", default=sys.executable, help="the venv whose kilolined is measured")
    ap.add_argument("--affinity", choices=("off", "prefix"), default=None,
                    help="send a 16 KiB chat body to an openai route with this affinity")
    args = ap.parse_args()
    with bl.workdir("callgrind") as wd, bl.Procs(wd) as procs:
        node_port = bl.free_port()
        bl.start_nginx_origin(procs, node_port)
        t0 = time.monotonic()
        a = run_one(args.python, wd, procs, node_port, args.n1, args.affinity)
        b = run_one(args.python, wd, procs, node_port, args.n2, args.affinity)
        per = (b - a) / (args.n2 - args.n1)
        what = "" if args.affinity is None else f" (16 KiB chat, affinity: {args.affinity})"
        print(f"{os.path.realpath(args.python)}{what}: {per:,.0f} instructions per request "
              f"({a:,} at {args.n1}, {b:,} at {args.n2}; {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
