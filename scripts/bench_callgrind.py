#!/usr/bin/env python3
"""Instructions per request of the gateway, counted by callgrind: repeatable on a busy box.

Wall-clock and CPU-time benchmarks on a shared 2-core machine move by ±30 % between runs;
instruction counts do not (valgrind's own docs: the same binary, inputs and environment give the
same count). The gateway runs under ``valgrind --tool=callgrind`` in front of nginx `return 200`;
a client sends N1, then N2 requests (keep-alive, 8 at a time); the difference of the two totals,
divided by N2 − N1, is the cost of one request with start-up and shutdown cancelled out.

``--floors all`` measures, the same way and against the same nginx, the floors of
``bench_floors.py`` (aiohttp answering itself, aiohttp's low-level server, a minimal aiohttp proxy
on our upstream client, bare uvloop + httptools) and prints the gateway's ratio to each.
``KL_BENCH_KEEP=1`` keeps the callgrind files, for ``callgrind_annotate --inclusive=yes``.

    python scripts/bench_callgrind.py [--n1 300 --n2 1300] [--python .venv/bin/python] [--floors all]

``--affinity off|prefix`` measures a 16 KiB OpenAI chat body instead, on an ``openai`` route at
``/v1`` over three nodes (one nginx) with that ``affinity``: the difference of the two is what
prefix affinity costs per request (the keys, the match on each node, the choice, the record).
Every request sends the same document, as a chat's follow-ups and a shared system prompt do: its
messages are found in the gateway's memo and compared, not hashed again. ``--distinct`` makes
each request's document a new one (its first bytes are the request's number), for what a prefix
never seen costs: its whole text cut into blocks and hashed.
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

import aiohttp
import benchlib as bl
import orjson

FLOORS = ("aiohttp-app", "aiohttp-server", "aiohttp-proxy", "uvloop-proxy")  # scripts/bench_floors.py


def chat_body(size: int = 16 * 1024, number: int | None = None) -> bytes:
    """A chat request of ``size`` bytes: a long system document and a short question; with a
    ``number``, a document that starts with it (another document for every number)."""
    doc = ("The quick brown fox jumps over the lazy dog. " * (size // 45 + 1))[: size - 200]
    if number is not None:
        doc = f"{number:010d} {doc[11:]}"
    return orjson.dumps({"model": "bench", "max_tokens": 8, "messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": "What does the fox do?"}]})


async def post_distinct(url: str, n: int, start: int, conc: int = 8) -> None:
    """``n`` POSTs as ``benchlib.post_keepalive`` sends them, each with another document."""
    bodies = iter([chat_body(number=start + i) for i in range(n)])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:
        async def worker() -> None:
            for body in bodies:
                async with s.post(url, data=body, headers={"Authorization": f"Bearer {bl.API_KEY}"}) as r:
                    await r.read()
                    assert r.status == 200, r.status

        await asyncio.gather(*(worker() for _ in range(conc)))


def send(url: str, body: bytes, n: int, distinct: int | None) -> None:
    """``n`` requests of ``body``, or with ``distinct`` (the first number) each with its own document."""
    if distinct is None:
        asyncio.run(bl.post_keepalive(url, n, body=body))
    else:
        asyncio.run(post_distinct(url, n, distinct))


def chat_routes(affinity: str) -> dict[str, dict[str, object]]:
    return {"llm": {"path": "/v1", "kind": "openai", "nodes": ["g1", "g2", "g3"], "max_concurrency": 512,
                    "max_queue_depth": 100000, "queue_timeout_sec": 600, "request_timeout_sec": 600,
                    "affinity": affinity}}


def request_of(port: int, affinity: str | None) -> tuple[str, bytes]:
    """The URL and body each measured request sends."""
    if affinity is None:
        return f"http://127.0.0.1:{port}/gen/generate", b'{"steps": 0}'
    return f"http://127.0.0.1:{port}/v1/chat/completions", chat_body()


def server_cmd(what: str, python: str, wd: Path, port: int, node_port: int, n: int,
               affinity: str | None = None) -> list[str]:
    """The command line of the server measured: the gateway, or one of the floors."""
    if what == "kilolined":
        node = f"http://127.0.0.1:{node_port}"
        if affinity is None:
            cfg = bl.gateway_config(port, {"gpu": node})
        else:
            cfg = bl.gateway_config(port, {"g1": node, "g2": node, "g3": node}, chat_routes(affinity))
        path = wd / f"gw-{n}.yaml"
        bl.write_yaml(path, cfg)
        return [python, str(Path(python).parent / "kilolined"), "--log-format", "text", "run", "-c", str(path)]
    floors = str(Path(__file__).resolve().parent / "bench_floors.py")
    return [python, floors, what, "--port", str(port), "--upstream", f"http://127.0.0.1:{node_port}"]


def run_one(what: str, python: str, wd: Path, node_port: int, n: int, affinity: str | None = None,
            distinct: bool = False) -> int:
    """Total instructions of one run of ``what`` serving 50 warm-up requests, then ``n``."""
    port = bl.free_port()
    out = wd / f"callgrind-{what}-{n}.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
           *server_cmd(what, python, wd, port, node_port, n, affinity)]
    log_path = wd / f"{what}-{n}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        bl.wait_port(port, timeout=1800, proc=p)  # minutes on a loaded box
        url, body = request_of(port, affinity)
        send(url, body, 50, 0 if distinct else None)  # warm-up, the same in both runs
        send(url, body, n, 50 if distinct else None)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log_path.read_text(errors="replace")
    m = re.search(r"Collected : (\d+)", text)
    if m is None:
        raise RuntimeError(text[-2000:])
    return int(m.group(1))


def run_zeroed(what: str, python: str, wd: Path, node_port: int, n: int, affinity: str | None = None,
               distinct: bool = False) -> float:
    """One run: after the warm-up the counters are zeroed (``callgrind_control -z``), ``n``
    requests are served, then dumped: instructions per request of exactly those ``n``, and a
    profile of nothing else (half the wall time of two runs; start-up under valgrind takes
    minutes on a loaded box)."""
    port = bl.free_port()
    out = wd / f"callgrind-{what}-z{n}.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
           *server_cmd(what, python, wd, port, node_port, n, affinity)]
    log_path = wd / f"{what}-z{n}.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        bl.wait_port(port, timeout=1800, proc=p)
        url, body = request_of(port, affinity)
        send(url, body, 50, 0 if distinct else None)
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True, timeout=600)
        send(url, body, n, 50 if distinct else None)
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True, timeout=600)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    dumps = sorted(wd.glob(f"{out.name}.*"))
    if not dumps:
        raise RuntimeError(log_path.read_text(errors="replace")[-2000:])
    m = re.search(r"^(?:totals|summary): (\d+)", dumps[0].read_text(errors="replace"), re.M)
    if m is None:
        raise RuntimeError(f"no totals in {dumps[0]}")
    per = int(m.group(1)) / n
    print(f"{what}: {per:,.0f} instructions per request (zeroed after warm-up, {n} requests; {dumps[0]})",
          flush=True)
    return per


def per_request(what: str, python: str, wd: Path, node_port: int, n1: int, n2: int, zeroed: bool = False,
                affinity: str | None = None, distinct: bool = False) -> float:
    if zeroed:
        return run_zeroed(what, python, wd, node_port, n2 - n1, affinity, distinct)
    a = run_one(what, python, wd, node_port, n1, affinity, distinct)
    b = run_one(what, python, wd, node_port, n2, affinity, distinct)
    per = (b - a) / (n2 - n1)
    print(f"{what}: {per:,.0f} instructions per request ({a:,} at {n1}, {b:,} at {n2})", flush=True)
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n1", type=int, default=300)
    ap.add_argument("--n2", type=int, default=1300)
    ap.add_argument("--python", default=sys.executable, help="the venv whose kilolined is measured")
    ap.add_argument("--floors", default="",
                    help=f"comma-separated floors to measure beside the gateway ({', '.join(FLOORS)}; 'all')")
    ap.add_argument("--no-gateway", action="store_true", help="measure the floors only")
    ap.add_argument("--affinity", choices=("off", "prefix"), default=None,
                    help="send a 16 KiB chat body to an openai route with this affinity")
    ap.add_argument("--distinct", action="store_true",
                    help="with --affinity: each request another document (a prefix never seen before)")
    ap.add_argument("--zeroed", action="store_true",
                    help="one run per server, counters zeroed after the warm-up, N2-N1 requests counted")
    args = ap.parse_args()
    if args.distinct and args.affinity is None:
        ap.error("--distinct needs --affinity")
    floors = list(FLOORS) if args.floors == "all" else [f for f in args.floors.split(",") if f]
    for f in floors:
        if f not in FLOORS:
            ap.error(f"unknown floor {f!r}")
    with bl.workdir("callgrind") as wd, bl.Procs(wd) as procs:
        node_port = bl.free_port()
        bl.start_nginx_origin(procs, node_port)
        t0 = time.monotonic()
        gw = None if args.no_gateway else per_request("kilolined", args.python, wd, node_port, args.n1, args.n2,
                                                          args.zeroed, args.affinity, args.distinct)
        if gw is not None:
            print(f"{os.path.realpath(args.python)}: {gw:,.0f} instructions per request")
        got = {f: per_request(f, args.python, wd, node_port, args.n1, args.n2, args.zeroed) for f in floors}
        if got:
            rows = [(f, f"{v:,.0f}", f"{gw / v:.2f}x" if gw else "-") for f, v in got.items()]
            bl.print_table(("floor", "instructions/request", "kilolined ÷ floor"), rows)
        print(f"({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
