#!/usr/bin/env python3
"""One ComfyUI over two REAL ComfyUI servers: inputs follow the prompt, outputs leave the node.

Starts a gateway in this process with one ``comfyui`` route over the two servers (one slot each)
and measures what docs/API.md "ComfyUI over several GPUs" promises:
  1a. N img2img prompts (upload through the gateway, then LoadImage → ImageInvert → SaveImage), as
      async jobs: how many complete, on which node;
  1b. N more the way a plain ComfyUI script sends them (POST /prompt, poll /history/{id}, /view at
      once): how many succeed, on which node, and whether each output is its own input inverted;
  2. the node running a slow prompt killed mid-prompt (a KLSlowProgress step between LoadImage and
     SaveImage; scripts/real_backends_setup.sh writes that node) → where the prompt completes; an
     async job, or with ``--failover sync`` a prompt as the web UI sends it (its client id, and
     what the page's socket hears);
  3. every output of 1 and 2 downloaded through ``/view`` after both servers are killed, each
     checked to be its own input inverted (needs Pillow);
  4. what a second key gets of the first key's files, history, queue and jobs;
  5. the memory the route's files hold (/admin/state, /metrics) and the bytes the gateway's
     process wrote to disk.

With ``--cluster`` it starts a redis-server (no persistence) and two gateways in cluster mode:
uploads, ``/view``, ``/history`` and ``/queue`` through gateway A, every prompt through gateway B.

Each server needs its own files (as two GPUs have): ``--input-directory``, ``--output-directory``,
``--temp-directory``, ``--user-directory`` and ``--database-url``. Give their pids to be killed:

    python scripts/check_comfy_files_real.py --node http://127.0.0.1:18188 --pid PID_A \\
        --node http://127.0.0.1:18189 --pid PID_B [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kilolined.adapters.comfy_control import comfy_state
from kilolined.core.config import parse_config
from kilolined.edge.server import Server

ADMIN_KEY = "kl_admin_real_check_key_00000000000"
KEYS = {"alice": "kl_alice_real_check_key_0000000000", "bob": "kl_bob_real_check_key_000000000000"}


def png(seed: str, size: int = 16) -> bytes:
    d = hashlib.sha256(seed.encode()).digest()
    rows = b"".join(b"\x00" + bytes((d[(x + y) % 32] + x * 7) % 256 for x in range(size * 3)) for y in range(size))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + tag + data + zlib.crc32(tag + data).to_bytes(4, "big")

    head = size.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def config(nodes: list[str], cluster: str = "") -> str:
    """The gateway's config; ``cluster``: its ``cluster:`` section's flow mapping."""
    names = [f"n{i}" for i in range(len(nodes))]
    admin = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    lines = ["server: {listen: '127.0.0.1:0'}", f"admin: {{key_sha256: {admin}}}", "keys:"]
    lines = lines if not cluster else [f"cluster: {cluster}", *lines]
    lines += [f"  {k}: {{key: {v}}}" for k, v in KEYS.items()]
    lines += ["nodes:"] + [f"  {n}: {{url: '{u}', health: {{path: /system_stats}}}}" for n, u in zip(names, nodes,
                                                                                                  strict=True)]
    lines += ["routes:", "  comfy:", "    path: /comfy", "    kind: comfyui", "    max_concurrency: 1",
              f"    nodes: [{', '.join(names)}]",
              "    request_timeout_sec: 120", "    queue_timeout_sec: 300"]
    return "\n".join(lines) + "\n"


def img2img(image: str, slow_ms: int = 0) -> dict[str, Any]:
    g: dict[str, Any] = {"1": {"class_type": "LoadImage", "inputs": {"image": image}},
                         "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
                         "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "kl"}}}
    if slow_ms:
        g["4"] = {"class_type": "KLSlowProgress", "inputs": {"steps": 40, "step_ms": slow_ms, "seed": 1,
                                                              "image": ["2", 0]}}
        g["3"]["inputs"]["images"] = ["4", 0]
    return g


async def start(cfg: str) -> Server:
    srv = Server(parse_config(cfg, env={}), hashlib.sha256(cfg.encode()).hexdigest(), "", watch=False)
    await srv.start()
    return srv


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY if who == 'admin' else KEYS[who]}"}


def disk_written() -> int:
    """Bytes this process (the gateway runs in it) has written to storage (/proc/self/io)."""
    io_stats = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io_stats["write_bytes"]) - int(io_stats["cancelled_write_bytes"])


async def held(http: aiohttp.ClientSession, base: str) -> str:
    """The route's file store as /admin/state and /metrics show it."""
    async with http.get(base + "/admin/state", headers=auth("admin")) as r:
        state = (await r.json())["routes"]["comfy"]["comfy_files"]
    async with http.get(base + "/metrics", headers=auth("admin")) as r:
        metric = [line for line in (await r.text()).splitlines() if line.startswith("kiloline_comfy_files_bytes{")]
    return f"/admin/state {state}, {' '.join(metric)}"


async def upload(http: aiohttp.ClientSession, base: str, name: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("image", data, filename=name, content_type="image/png")
    async with http.post(base + "/comfy/upload/image", data=form, headers=auth("alice")) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["name"])


async def job(http: aiohttp.ClientSession, base: str, srv: Server, graph: dict[str, Any]) -> Any:
    async with http.post(base + "/comfy/prompt", json={"prompt": graph},
                         headers={**auth("alice"), "X-KiloLine-Mode": "async"}) as r:
        assert r.status == 202, await r.text()
        jid = (await r.json())["job_id"]
    jobs = srv.gateway.jobs
    while jobs.jobs[jid].status not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.1)
    return jobs.jobs[jid]


def outputs(j: Any) -> list[dict[str, Any]]:
    res = j.result.result if j.result is not None and j.result.result is not None else {}
    return [i for out in res.get("outputs", {}).values() for i in out.get("images", [])]


async def view(http: aiohttp.ClientSession, base: str, img: dict[str, Any], who: str = "alice") -> tuple[int, bytes]:
    q = {k: img[k] for k in ("filename", "subfolder", "type")}
    async with http.get(base + "/comfy/view", params=q, headers=auth(who)) as r:
        return r.status, await r.read()


async def plain(http: aiohttp.ClientSession, back: str, front: str, graph: dict[str, Any]) -> dict[str, Any]:
    """A prompt the way a ComfyUI script sends it: POST /prompt (to ``back``), then /history/{id}
    (from ``front``) until it is there."""
    async with http.post(back + "/comfy/prompt", json={"prompt": graph}, headers=auth("alice")) as r:
        assert r.status == 200, await r.text()
        pid = (await r.json())["prompt_id"]
    return await plain_entry(http, front, pid)


async def plain_entry(http: aiohttp.ClientSession, front: str, pid: str) -> dict[str, Any]:
    """The prompt's history entry once it is there (``/history/{id}``)."""
    while True:
        async with http.get(front + f"/comfy/history/{pid}", headers=auth("alice")) as r:
            entry = (await r.json()).get(pid)
        if entry is not None:
            return dict(entry)
        await asyncio.sleep(0.2)


async def copies_done(srv: Server) -> None:
    while srv.rt.adapter_state.get("comfyfiles") is not None and srv.rt.adapter_state["comfyfiles"].copies:
        await asyncio.sleep(0.05)


def node_of(j: Any) -> str:
    """The node a job was last dispatched to (its ``dispatched`` events)."""
    found = "?"
    for _, name, raw in j.events:
        if name == "dispatched":
            data = orjson.loads(raw.decode().split("data: ", 1)[1])
            found = data.get("node", found)
    return found


def inverted(given: bytes, out: bytes) -> bool:
    """Is ``out`` (SaveImage's PNG) ``given`` with its pixels inverted: this prompt's own file?
    (ComfyUI inverts in floats and SaveImage truncates: 255 - v or one less.)"""
    from PIL import Image  # Pillow: only for this check

    a = Image.open(io.BytesIO(given)).convert("RGB")
    b = Image.open(io.BytesIO(out)).convert("RGB")
    return a.size == b.size and all(254 <= x + y <= 255 for x, y in zip(a.tobytes(), b.tobytes(), strict=True))


async def bob_sees(http: aiohttp.ClientSession, base: str, pids: list[str]) -> dict[str, Any]:
    """What the second key gets of the first key's prompts: history, queue, jobs."""
    seen: dict[str, Any] = {}
    for path in ("/history", "/queue", "/api/jobs", f"/history/{pids[0]}", f"/api/jobs/{pids[0]}"):
        async with http.get(base + "/comfy" + path, headers=auth("bob")) as r:
            body = await r.json()
        seen[path.replace(pids[0], "{id}")] = (r.status, len(body.get("jobs", [])) if path == "/api/jobs" else
                                               sum(len(v) for v in body.values()) if path == "/queue" else
                                               len(body) if r.status == 200 else body.get("error", body))
    return seen


async def listed(http: aiohttp.ClientSession, base: str, pids: list[str]) -> dict[str, int]:
    """How many of ``pids`` the first key finds in the route's /history and /api/jobs lists."""
    async with http.get(base + "/comfy/history", headers=auth("alice")) as r:
        history = await r.json()
    async with http.get(base + "/comfy/api/jobs", params={"limit": "1000"}, headers=auth("alice")) as r:
        jobs = {j["id"] for j in (await r.json()).get("jobs", [])}
    return {"/history": sum(p in history for p in pids), "/api/jobs": sum(p in jobs for p in pids)}


async def queue_seen(http: aiohttp.ClientSession, base: str, until: asyncio.Future[Any]) -> int:
    """The most prompts the first key's /queue showed (running + pending) until ``until`` is done."""
    most = 0
    while not until.done():
        async with http.get(base + "/comfy/queue", headers=auth("alice")) as r:
            q = await r.json()
        most = max(most, len(q.get("queue_running", [])) + len(q.get("queue_pending", [])))
        await asyncio.sleep(0.2)
    return most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server without persistence on a free port, for the length of the block: its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


async def sync_failover(http: aiohttp.ClientSession, front: str, back: str, back_srv: Server, name: str,
                        data: bytes, pids: dict[str, int], made: list[tuple[bytes, dict[str, Any]]]) -> str:
    """Step 2 as the web UI meets it: a sync prompt sent with the page's client id, its node killed
    mid-prompt; what the page's socket (on the front gateway) heard, and the history entry."""
    client = "klcheck-page"
    heard: list[str] = []
    async with http.ws_connect(front + f"/comfy/ws?clientId={client}", headers=auth("alice")) as ws:
        async with http.post(back + "/comfy/prompt", json={"prompt": img2img(name, slow_ms=100), "client_id": client},
                             headers=auth("alice")) as r:
            assert r.status == 200, await r.text()
            pid = (await r.json())["prompt_id"]
        record = comfy_state(back_srv.rt).owners("comfy")
        p = record.get(pid)
        first = p.node if p is not None else "?"

        async def listen() -> None:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                m = orjson.loads(msg.data)
                if m["data"].get("prompt_id") == pid:
                    heard.append(m["type"])
                    if m["type"] == "executing" and m["data"].get("node") is None:
                        return

        listening = asyncio.ensure_future(listen())
        await asyncio.sleep(2.0)
        os.kill(pids[first], signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(listening, 60)
    try:
        entry = await asyncio.wait_for(plain_entry(http, front, pid), 60)
    except TimeoutError:
        entry = {"status": {"status_str": "no history entry within 60 s"}}
    p = record.get(pid)
    outs = [i for out in entry.get("outputs", {}).values() for i in out.get("images", [])]
    own = [await view(http, front, i) for i in outs]
    print(f"2. (sync, as the web UI) {first} killed mid-prompt: {entry.get('status', {}).get('status_str')} "
          f"on {p.node if p is not None else '?'}, under its prompt id; its output its own input inverted: "
          f"{[s == 200 and inverted(data, b) for s, b in own]}; the page's socket heard "
          f"{dict(Counter(k for k in heard if k not in ('progress', 'progress_state')))} "
          f"and {heard.count('progress')} progress")
    made += [(data, i) for i in outs]
    return first


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", action="append", required=True, help="a ComfyUI's URL (two)")
    ap.add_argument("--pid", action="append", type=int, required=True, help="its pid, to kill it (same order)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--cluster", action="store_true", help="two gateways over a redis-server")
    ap.add_argument("--failover", choices=("async", "sync"), default="async",
                    help="step 2's prompt: an async job, or a sync prompt as the web UI sends it")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if not args.cluster:
            front = back = await start(config(args.node))
        else:
            url = stack.enter_context(redis_server())
            front, back = [await start(config(args.node, f"{{redis_url: '{url}', gateway_id: {gid}, "
                                                          "lease_ttl_sec: 5, key_prefix: 'klcheck:'}"))
                           for gid in ("gw-a", "gw-b")]
            print(f"cluster: gateways A :{front.port} (uploads, /view, /history, /queue) and B :{back.port} "
                  f"(prompts) over {url}")
        try:
            await check(args, front, back)
        finally:
            for srv in {front, back}:
                await srv.shutdown()


async def check(args: argparse.Namespace, front_srv: Server, back_srv: Server) -> None:
    pids = {f"n{i}": pid for i, pid in enumerate(args.pid)}
    front, back = f"http://127.0.0.1:{front_srv.port}", f"http://127.0.0.1:{back_srv.port}"
    made: list[tuple[bytes, dict[str, Any]]] = []  # (the input, the output the gateway named for it)
    written = disk_written()
    async with aiohttp.ClientSession() as http:
        # 1a. N img2img prompts over both nodes, as async jobs.
        t0 = time.monotonic()
        given = [png(f"in{i}") for i in range(args.prompts)]
        names = [await upload(http, front, f"in{i}.png", data) for i, data in enumerate(given)]
        done = await asyncio.gather(*(job(http, back, back_srv, img2img(n)) for n in names))
        ok = [j for j in done if j.status == "completed"]
        print(f"1a. async jobs: {len(ok)}/{len(done)} img2img prompts completed in {time.monotonic() - t0:.1f}s, "
              f"by node {dict(Counter(node_of(j) for j in ok))}")
        for j in done:
            if j.status != "completed":
                print("   failed:", j.events[-1][2][:300])
        made += [(data, i) for data, j in zip(given, done, strict=True) if j.status == "completed" for i in outputs(j)]
        # 1b. the same as a plain ComfyUI script: POST /prompt, poll /history/{id}, GET /view at once.
        t0 = time.monotonic()
        given = [png(f"plain{i}") for i in range(args.prompts)]
        names = [await upload(http, front, f"plain{i}.png", data) for i, data in enumerate(given)]
        entries = await asyncio.gather(*(plain(http, back, front, img2img(n)) for n in names))
        fine = [e.get("status", {}).get("status_str") == "success" for e in entries]
        mine = [(data, i) for data, e, f in zip(given, entries, fine, strict=True) if f
                for out in e.get("outputs", {}).values() for i in out.get("images", [])]
        own = [s == 200 and inverted(data, b) for data, (s, b) in
               [(data, await view(http, front, i)) for data, i in mine]]
        record = comfy_state(back_srv.rt).owners("comfy")
        plain_ids = [str(e["prompt"][1]) for e in entries]
        ran = Counter(p.node for pid in plain_ids if (p := record.get(pid)) is not None)
        print(f"1b. plain API: {sum(fine)}/{len(entries)} succeeded in {time.monotonic() - t0:.1f}s, "
              f"by node {dict(ran)}; "
              f"{sum(own)}/{len(mine)} outputs fetched at once through /view are their own input inverted")
        print(f"    of the {len(plain_ids)} prompts, listed in {await listed(http, front, plain_ids)}")
        made += mine
        print(f"    {len(made)} outputs, {len({i['filename'] for _, i in made})} distinct route names")

        # 2. the node running a slow prompt killed mid-prompt: re-queued to the other one, with its input.
        data = png("failover")
        name = await upload(http, front, "failover.png", data)
        if args.failover == "async":
            task = asyncio.ensure_future(job(http, back, back_srv, img2img(name, slow_ms=100)))
            seen = asyncio.ensure_future(queue_seen(http, front, task))
            await asyncio.sleep(2.0)
            jobs = back_srv.gateway.jobs.jobs
            first = node_of(jobs[list(jobs)[-1]])
            os.kill(pids[first], signal.SIGKILL)
            j = await task
            kinds = [e[1] for e in j.events]
            print(f"2. {first} killed mid-prompt: job {j.status} on {node_of(j)}; "
                  f"events {[k for k in kinds if k != 'step_progress']}; "
                  f"/queue on the front showed at most {await seen} running or pending")
            made += [(data, i) for i in outputs(j)]
        else:
            first = await sync_failover(http, front, back, back_srv, name, data, pids, made)
        await copies_done(back_srv)

        # 3. every output after both servers are gone: its own bytes.
        for n, pid in pids.items():
            if n != first:
                os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        got = [(data, await view(http, front, i)) for data, i in made]
        good = sum(s == 200 and inverted(data, b) for data, (s, b) in got)
        print(f"3. after both servers were killed: {good}/{len(got)} outputs downloadable through /view, "
              "each its own input inverted")
        # 4. another key.
        bob = sorted({(await view(http, front, i, "bob"))[0] for _, i in made})
        print(f"4. bob's /view of alice's outputs: {bob}")
        print(f"   bob's (status, entries): {await bob_sees(http, front, plain_ids)}")
        print(f"5. held in memory: {await held(http, front)}; written to disk by the gateway's process: "
              f"{disk_written() - written} bytes")


if __name__ == "__main__":
    asyncio.run(main())
