#!/usr/bin/env python3
"""Check kilolined against a REAL ComfyUI and a REAL llama.cpp `llama-server`, on loopback.

Starts a kilolined gateway in this process (kilolined.edge.server.Server, port picked by the OS) with
routes of kind `comfyui` and `openai` over the given servers, drives it the way real clients do
(sync POST /prompt, sse jobs, the `openai` SDK) and reads the servers' own state (ComfyUI's
/queue and /history, llama.cpp's answers) to see what really reached them. Prints one table:
check, expected, observed, PASS/FAIL. Exit status 0 only when every check passed.

The servers are set up by scripts/real_backends_setup.sh (docs/BACKENDS.md has the commands):
ComfyUI with its custom node `kl_test_nodes` (KLSlowProgress: sleeps per step and reports through
comfy.utils.ProgressBar, outputs a blank IMAGE; KLFail: raises), llama-server with a tiny
random-weight GGUF and `--api-key`.

    .venv/bin/pip install openai
    .venv/bin/python scripts/check_real_backends.py --comfy-url http://127.0.0.1:8188 \\
        --llama-url http://127.0.0.1:8080 --llama-key kl-node-key \\
        [--comfy-dir $REAL_DIR/comfyui --comfy-python $REAL_DIR/comfy-venv/bin/python] \\
        [--only comfy|openai] [--observe observations.txt] [--markdown table.md]

--comfy-dir/--comfy-python let the "node killed mid-job" check start (and SIGKILL) a second
ComfyUI of its own on --spare-port; without them that check is skipped. --observe writes the raw
protocol frames of both servers (websocket messages, error bodies, last stream chunks) to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml
from aiohttp import web

from kilolined.core.config import parse_config
from kilolined.edge.server import Server

KEYS = {"alice": "kl_alice_real_check_key_0000000000000", "bob": "kl_bob_real_check_key_00000000000000000",
        "carol": "kl_carol_real_check_key_000000000000000"}
ADMIN_KEY = "kl_admin_real_check_key_000000000000"
CAROL_TOKENS_PER_DAY = 300
# A 1x1 PNG for /upload/image.
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")
# What a Python traceback or a server-side file path looks like inside a JSON text.
LEAK = re.compile(r'Traceback|File \\?"|\.py\b|site-packages|line \d+, in ')


def leaks(text: str) -> list[str]:
    return sorted({re.sub(r"\d+", "N", m) for m in LEAK.findall(text)})


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def auth(who: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@dataclass
class Row:
    check: str
    expected: str
    observed: str
    ok: bool | None  # None: skipped


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, check: str, expected: str, observed: str, ok: bool | None) -> None:
        self.rows.append(Row(check, expected, observed, ok))
        mark = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        print(f"[{mark}] {check}: {observed}", file=sys.stderr, flush=True)

    def markdown(self) -> str:
        out = ["| check | expected | observed | result |", "| --- | --- | --- | --- |"]
        for r in self.rows:
            mark = "SKIP" if r.ok is None else ("PASS" if r.ok else "FAIL")
            cells = [c.replace("|", "\\|").replace("\n", " ") for c in (r.check, r.expected, r.observed)]
            out.append(f"| {cells[0]} | {cells[1]} | {cells[2]} | {mark} |")
        return "\n".join(out)


class Notes:
    """Raw observations of the real servers, written verbatim to --observe."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, title: str, text: str) -> None:
        self.parts.append(f"### {title}\n{text.rstrip()}\n")

    def text(self) -> str:
        return "\n".join(self.parts)


# --- ComfyUI workflows made of the weight-free test nodes ------------------------------------------

def workflow(seed: int, steps: int = 3, step_ms: int = 100, progress_nodes: int = 1, save: bool = True) -> dict:
    wf: dict[str, Any] = {}
    prev: list[Any] | None = None
    for i in range(progress_nodes):
        inputs: dict[str, Any] = {"steps": steps, "step_ms": step_ms, "seed": seed}
        if prev is not None:
            inputs["image"] = prev
        wf[str(10 + i)] = {"class_type": "KLSlowProgress", "inputs": inputs}
        prev = [str(10 + i), 0]
    out = "SaveImage" if save else "PreviewImage"
    wf["9"] = {"class_type": out, "inputs": {"images": prev, **({"filename_prefix": "klcheck"} if save else {})}}
    return wf


def failing_workflow(seed: int) -> dict:
    return {"1": {"class_type": "KLFail", "inputs": {"seed": seed}},
            "9": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}


_seed = int(time.time() * 1000) % 10**9


def fresh_seed() -> int:
    # Unique per run and per call, so ComfyUI's cache never answers a check's prompt.
    global _seed
    _seed += 1
    return _seed


class Comfy:
    """Direct access to the ComfyUI node (never through the gateway): the ground truth."""

    def __init__(self, http: aiohttp.ClientSession, url: str):
        self.http, self.url = http, url.rstrip("/")

    async def queue_count(self) -> tuple[int, list[str]]:
        async with self.http.get(self.url + "/queue") as r:
            q = await r.json()
        items = q.get("queue_running", []) + q.get("queue_pending", [])
        return len(items), [it[1] for it in q.get("queue_running", [])]

    async def history(self, pid: str) -> dict | None:
        async with self.http.get(f"{self.url}/history/{pid}") as r:
            h = await r.json()
        return h.get(pid)

    async def post_prompt(self, wf: dict, **extra: Any) -> dict:
        async with self.http.post(self.url + "/prompt", json={"prompt": wf, **extra}) as r:
            return await r.json()

    async def wait_done(self, pid: str, number: int | None = None, timeout: float = 60) -> dict | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            h = await self.history(pid)
            if h is not None and (number is None or h["prompt"][0] == number):
                return h
            await asyncio.sleep(0.01)
        return None

    async def wait_idle(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            n, _ = await self.queue_count()
            if n == 0:
                return
            await asyncio.sleep(0.05)

    async def interrupt_all(self) -> None:
        async with self.http.post(self.url + "/queue", json={"clear": True}):
            pass
        async with self.http.post(self.url + "/interrupt", json={}):
            pass


def interrupted(h: dict | None) -> bool:
    return bool(h) and any(m[0] == "execution_interrupted" for m in h.get("status", {}).get("messages", []))


class QueueWatch:
    """Polls the node's /queue every 20 ms; keeps the most prompts it ever saw running + pending."""

    def __init__(self, comfy: Comfy):
        self.comfy, self.max = comfy, 0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                n, _ = await self.comfy.queue_count()
                self.max = max(self.max, n)
            await asyncio.sleep(0.02)

    def __enter__(self) -> QueueWatch:
        self.task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    event, data = "message", []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    yield event, json.loads(text)
                except ValueError:
                    yield event, text
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


async def sse_job(http: aiohttp.ClientSession, url: str, body: dict, who: str = "alice",
                  on_event: Callable[[str, Any], Awaitable[None]] | None = None,
                  timeout: float = 120) -> list[tuple[str, Any]]:
    got: list[tuple[str, Any]] = []
    hdrs = {**auth(who), "X-KiloLine-Mode": "sse"}
    async with http.post(url, json=body, headers=hdrs, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            return [("http_error", {"status": r.status, "body": await r.text()})]
        async for ev, data in sse_events(r):
            got.append((ev, data))
            if on_event is not None:
                await on_event(ev, data)
            if ev in ("output_ready", "failed"):
                break
    return got


async def timed(coro: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.monotonic()
    try:
        res = await coro
    except Exception as e:  # the observed failure is the result
        res = e
    return time.monotonic() - t0, res


def short(x: Any, n: int = 160) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= n else s[: n - 1] + "…"


# --- gateway ----------------------------------------------------------------------------------------

def gateway_config(a: argparse.Namespace, v1only_url: str, spare_url: str | None) -> dict[str, Any]:
    node_hdr = {"Authorization": f"Bearer {a.llama_key}"} if a.llama_key else {}
    nodes: dict[str, Any] = {
        "comfy": {"url": a.comfy_url, "max_concurrency": 1, "health": {"path": "/system_stats", "interval_sec": 1}},
        "llama": {"url": a.llama_url, "headers": node_hdr, "health": {"path": "/health", "interval_sec": 1}},
        "llama-badkey": {"url": a.llama_url, "headers": {"Authorization": "Bearer wrong-node-key"},
                         "health": {"path": "/health", "interval_sec": 1}},
        # Behind a route with its own prefix, nginx's "proxy_pass with a URI": the prefix is cut
        # (strip_path: true) and the node's url carries /v1. The shipped /v1 route needs neither.
        "llama-v1only": {"url": v1only_url + "/v1", "headers": node_hdr,
                         "health": {"path": "/models", "interval_sec": 1}},
    }
    comfy = {"kind": "comfyui", "nodes": ["comfy"], "max_concurrency": 1, "queue_timeout_sec": 120,
             "request_timeout_sec": 120, "expected_duration_sec": 1}
    routes: dict[str, Any] = {
        "comfy": {**comfy, "path": "/comfy"},
        "comfyto": {**comfy, "path": "/comfyto", "request_timeout_sec": 2},
        # As the shipped example has it: OpenAI clients use base_url = gateway + "/v1".
        "llm": {"path": "/v1", "kind": "openai", "nodes": ["llama"], "max_concurrency": 2,
                "queue_timeout_sec": 120, "request_timeout_sec": 120},
        "llmbad": {"path": "/bad/v1", "kind": "openai", "nodes": ["llama-badkey"], "max_concurrency": 2},
        "llmv1": {"path": "/vllm/v1", "kind": "openai", "nodes": ["llama-v1only"], "max_concurrency": 2,
                  "strip_path": True},
    }
    if spare_url:
        nodes["comfy-spare"] = {"url": spare_url, "max_concurrency": 1,
                                "health": {"path": "/system_stats", "interval_sec": 1}}
        routes["comfykill"] = {**comfy, "path": "/comfykill", "nodes": ["comfy-spare"], "standby": ["comfy"],
                               "retry_on_failover": 1}
    # Only the servers this run checks: a node that is not running would only fill the log.
    wanted = {"comfy": "comfyui", "openai": "openai"}.get(a.only or "")
    if wanted:
        routes = {n: r for n, r in routes.items() if r["kind"] == wanted}
        used = {x for r in routes.values() for x in r["nodes"] + r.get("standby", [])}
        nodes = {n: v for n, v in nodes.items() if n in used}
    keys: dict[str, Any] = {k: {"key_sha256": sha(v), "routes": ["*"]} for k, v in KEYS.items()}
    keys["carol"]["budget"] = {"tokens_per_day": CAROL_TOKENS_PER_DAY}
    return {"server": {"listen": "127.0.0.1:0", "heartbeat_sec": 1, "shutdown_grace_sec": 2},
            "admin": {"key_sha256": sha(ADMIN_KEY), "public_metrics": True},
            "keys": keys, "nodes": nodes, "routes": routes}


async def start_gateway(cfg: dict[str, Any], workdir: Path) -> Server:
    path = workdir / "kiloline.yaml"
    text = yaml.safe_dump(cfg)
    path.write_text(text)
    srv = Server(parse_config(text, env={}), sha(text), str(path), watch=False)
    await srv.start()
    return srv


class V1OnlyProxy:
    """A vLLM-shaped front for llama.cpp: only /v1/... exists (404 otherwise); records each path."""

    def __init__(self, target: str):
        self.target, self.paths = target.rstrip("/"), []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, req: web.Request) -> web.StreamResponse:
        self.paths.append(req.path)
        if not req.path.startswith("/v1/"):
            return web.json_response({"object": "error", "message": f"Not Found: {req.path}", "code": 404},
                                     status=404)
        hdrs = {k: v for k, v in req.headers.items() if k.lower() in ("authorization", "content-type")}
        async with aiohttp.ClientSession() as s, s.request(req.method, self.target + req.path_qs,
                                                            data=await req.read(), headers=hdrs) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})
            await out.prepare(req)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


async def metric(http: aiohttp.ClientSession, gw: str, name: str, labels: dict[str, str]) -> float:
    async with http.get(gw + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- observations: the real servers' raw frames -----------------------------------------------------

async def observe_comfy(http: aiohttp.ClientSession, comfy: Comfy, notes: Notes) -> None:
    cid = "klobserve-" + uuid.uuid4().hex[:8]
    seed = fresh_seed()

    async def run(title: str, body: dict, interrupt_after: int | None = None) -> str:
        frames: list[str] = []
        progress = 0
        async with http.ws_connect(f"{comfy.url}/ws?clientId={cid}") as ws:
            async with http.post(comfy.url + "/prompt", json={**body, "client_id": cid}) as r:
                answer = f"HTTP {r.status} {await r.text()}"
            pid = json.loads(answer.split(" ", 2)[2]).get("prompt_id")
            end = time.monotonic() + 30
            while time.monotonic() < end:
                msg = await ws.receive(timeout=30)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    frames.append(f"<{msg.type.name} {len(msg.data) if msg.data else 0} bytes>")
                    continue
                frames.append(msg.data)
                d = json.loads(msg.data)
                if d["type"] == "progress":
                    progress += 1
                    if progress == interrupt_after:
                        async with http.post(comfy.url + "/interrupt", json={}) as ir:
                            frames.append(f"<POST /interrupt {{}} -> HTTP {ir.status} {await ir.text()!r}>")
                if d["type"] == "executing" and d["data"].get("node") is None and d["data"].get("prompt_id") == pid:
                    break
        notes.add(title, f"POST /prompt -> {answer}\nwebsocket frames, in order:\n" + "\n".join(frames))
        return pid

    wf = workflow(seed, steps=3, step_ms=150, progress_nodes=1)
    pid = str(uuid.uuid4())
    await run("ComfyUI: one fresh prompt (KLSlowProgress 3 steps -> SaveImage)", {"prompt": wf, "prompt_id": pid})
    cached = await run("ComfyUI: the same prompt again (fully cached)", {"prompt": wf})
    ch = await comfy.history(cached)
    notes.add("ComfyUI: /history of the fully cached run: outputs and messages",
              short({"outputs": ch.get("outputs") if ch else None,
                     "messages": [m[0] for m in (ch or {}).get("status", {}).get("messages", [])]}, 800))
    wf2 = workflow(fresh_seed(), steps=2, step_ms=150)
    await run("ComfyUI: a new prompt reusing the first prompt's prompt_id", {"prompt": wf2, "prompt_id": pid})
    h = await comfy.history(pid)
    await run("ComfyUI: a prompt interrupted (POST /interrupt {}) after its 2nd progress",
              {"prompt": workflow(fresh_seed(), 10, 150)}, interrupt_after=2)
    await run("ComfyUI: a failing prompt (KLFail)", {"prompt": failing_workflow(fresh_seed())})
    notes.add("ComfyUI: /history/{reused id} after the second run (prompt[0] = number)",
              short({"prompt[0]": h["prompt"][0] if h else None, "status": h.get("status") if h else None}, 2000))
    async with http.post(comfy.url + "/prompt", json={"prompt": failing_workflow(fresh_seed())}) as r:
        fpid = (await r.json())["prompt_id"]
    fh = await comfy.wait_done(fpid, timeout=20)
    err = [m for m in (fh or {}).get("status", {}).get("messages", []) if m[0] == "execution_error"]
    notes.add("ComfyUI: execution_error in /history of a failing prompt", short(err, 3000))
    for path in ("/features", "/api/features", "/api/jobs?limit=1", "/queue"):
        async with http.get(comfy.url + path) as r:
            notes.add(f"ComfyUI: GET {path}", f"HTTP {r.status} {short(await r.text(), 700)}")
    async with http.post(comfy.url + "/prompt", data=b"not json", headers={"Content-Type": "application/json"}) as r:
        notes.add("ComfyUI: POST /prompt with a non-JSON body", f"HTTP {r.status} {r.content_type} {await r.text()}")


async def observe_llama(http: aiohttp.ClientSession, a: argparse.Namespace, notes: Notes) -> None:
    url = a.llama_url.rstrip("/")
    key = {"Authorization": f"Bearer {a.llama_key}"} if a.llama_key else {}
    long_msg = [{"role": "user", "content": "hello " * 3000}]
    for stream in (False, True):
        async with http.post(url + "/v1/chat/completions", headers=key,
                             json={"messages": long_msg, "max_tokens": 4, "stream": stream}) as r:
            notes.add(f"llama.cpp: context overflow, stream={stream}",
                      f"HTTP {r.status} {r.content_type}\n{short(await r.text(), 1500)}")
    async with http.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer wrong"},
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) as r:
        notes.add("llama.cpp: wrong API key", f"HTTP {r.status} {r.content_type}\n{await r.text()}")
    async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        notes.add("llama.cpp: no API key", f"HTTP {r.status} {r.content_type}\n{await r.text()}")
    for usage in (False, True):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4,
                                "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        async with http.post(url + "/v1/chat/completions", headers=key, json=body) as r:
            lines = [ln for ln in (await r.text()).splitlines() if ln.strip()]
        notes.add(f"llama.cpp: last lines of a stream, include_usage={usage}", "\n".join(lines[-3:]))
    async with http.post(url + "/chat/completions", headers=key,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
        notes.add("llama.cpp: POST /chat/completions (no /v1)", f"HTTP {r.status} {short(await r.text(), 400)}")
    async with http.get(url + "/v1/models", headers=key) as r:
        models = await r.json()
        notes.add("llama.cpp: GET /v1/models", f"HTTP {r.status} {short(models, 1200)}")
    mid = models["data"][0]["id"] if models.get("data") else "x"
    for path in (f"/v1/models/{mid}", "/v1/models/no-such-model", "/health", "/v1/health"):
        async with http.get(url + path, headers=key) as r:
            notes.add(f"llama.cpp: GET {path}", f"HTTP {r.status} {short(await r.text(), 800)}")


# --- ComfyUI checks ---------------------------------------------------------------------------------

async def comfy_checks(http: aiohttp.ClientSession, gw: str, comfy: Comfy, rep: Report,
                       spare: Callable[[], Awaitable[tuple[Any, Callable[[], None]] | None]]) -> None:
    g = gw + "/comfy"

    async def sync_post(body: dict, who: str = "alice", base: str = g, path: str = "/prompt") -> Any:
        async with http.post(base + path, json=body, headers=auth(who),
                             timeout=aiohttp.ClientTimeout(total=180)) as r:
            return r.status, await r.json(content_type=None)

    # 1. slot cap in sync mode
    with QueueWatch(comfy) as w:
        answers = await asyncio.gather(*(sync_post({"prompt": workflow(fresh_seed(), 4, 100)}) for _ in range(4)))
        await comfy.wait_idle()
    rep.add("comfy: sync slot cap (4 sync prompts, max_concurrency 1)", "node /queue running+pending <= 1",
            f"max {w.max}; POST statuses {[s for s, _ in answers]}", w.max <= 1)

    # 2. a reused prompt_id holds its slot like any other
    pid = str(uuid.uuid4())
    await sync_post({"prompt": workflow(fresh_seed(), 1, 10), "prompt_id": pid})
    await comfy.wait_done(pid)
    with QueueWatch(comfy) as w:
        await asyncio.gather(*(sync_post({"prompt": workflow(fresh_seed(), 4, 100), "prompt_id": pid})
                               for _ in range(4)))
        await comfy.wait_idle()
    rep.add("comfy: reused prompt_id (4 sync POSTs reusing a finished id)", "node /queue running+pending <= 1",
            f"max {w.max}", w.max <= 1)

    # 3. how fast a sync slot is freed: 20 trivial prompts, direct vs sse vs sync
    n = 20
    t0 = time.monotonic()
    posted = await asyncio.gather(*(comfy.post_prompt(workflow(fresh_seed(), 1, 0, save=False)) for _ in range(n)))
    await asyncio.gather(*(comfy.wait_done(p["prompt_id"]) for p in posted))
    direct = time.monotonic() - t0
    t0 = time.monotonic()
    await asyncio.gather(*(sse_job(http, g + "/prompt", {"prompt": workflow(fresh_seed(), 1, 0, save=False)})
                           for _ in range(n)))
    via_sse = time.monotonic() - t0
    t0 = time.monotonic()
    posted = await asyncio.gather(*(sync_post({"prompt": workflow(fresh_seed(), 1, 0, save=False)})
                                    for _ in range(n)))
    await asyncio.gather(*(comfy.wait_done(b["prompt_id"]) for _, b in posted if isinstance(b, dict)
                           and "prompt_id" in b))
    via_sync = time.monotonic() - t0
    rep.add(f"comfy: sync frees the slot at once ({n} trivial prompts)", "sync <= sse + 1.0 s (< 50 ms/prompt)",
            f"direct {direct:.2f} s, sse {via_sse:.2f} s, sync {via_sync:.2f} s", via_sync <= via_sse + 1.0)
    await comfy.wait_idle()

    # 4. a sync prompt past request_timeout_sec (2 s on /comfyto) is interrupted before its slot is reused
    long_body = {"prompt": workflow(fresh_seed(), 40, 100)}
    with QueueWatch(comfy) as w:
        _, la = await sync_post(long_body, base=gw + "/comfyto")
        await asyncio.sleep(0.2)
        short_task = asyncio.create_task(sync_post({"prompt": workflow(fresh_seed(), 1, 10)}, base=gw + "/comfyto"))
        lh = await comfy.wait_done(la.get("prompt_id", "-"), timeout=10)
        await short_task
        await comfy.wait_idle()
    took = "not finished" if lh is None else ("interrupted" if interrupted(lh) else lh["status"]["status_str"])
    rep.add("comfy: sync timeout (request_timeout_sec 2, a 4 s prompt)",
            "prompt interrupted; node running+pending <= 1", f"long prompt {took}; max {w.max}",
            interrupted(lh) and w.max <= 1)

    # 5/6. non-GPU endpoints and control endpoints while a prompt holds the slot. Each phase has a
    # fresh 4 s prompt, so a request that does queue cannot hide the next one's behaviour.
    t_out = aiohttp.ClientTimeout(total=60)

    async def busy(steps: int = 40) -> str:
        _, ans = await sync_post({"prompt": workflow(fresh_seed(), steps, 100)})
        pid = ans.get("prompt_id", "-") if isinstance(ans, dict) else "-"
        end = time.monotonic() + 10
        while time.monotonic() < end and pid not in (await comfy.queue_count())[1]:
            await asyncio.sleep(0.02)
        return pid

    async def get(path: str, who: str = "alice") -> tuple[int, str]:
        async with http.get(g + path, headers=auth(who), timeout=t_out) as r:
            return r.status, await r.text()

    async def upload() -> tuple[int, str]:
        form = aiohttp.FormData()
        form.add_field("image", PNG, filename="klcheck.png", content_type="image/png")
        form.add_field("overwrite", "true")
        async with http.post(g + "/upload/image", data=form, headers=auth(), timeout=t_out) as r:
            return r.status, await r.text()

    await busy()
    names = ("GET /features", "GET /api/features", "GET /api/jobs", "POST /upload/image")
    got = await asyncio.gather(timed(get("/features")), timed(get("/api/features")), timed(get("/api/jobs")),
                               timed(upload()))
    for name, (dt, res) in zip(names, got, strict=True):
        st = res[0] if isinstance(res, tuple) else type(res).__name__
        rep.add(f"comfy: {name} while a 4 s prompt runs", "answered < 0.5 s, not queued",
                f"{dt:.2f} s, HTTP {st}", dt < 0.5 and st == 200)
    await comfy.wait_idle()

    alice_pid = await busy()
    queued_task = asyncio.create_task(sync_post({"prompt": workflow(fresh_seed(), 1, 10)}))
    await asyncio.sleep(0.3)
    (dt_i, res_i), (dt_c, res_c) = await asyncio.gather(timed(sync_post({}, who="bob", path="/interrupt")),
                                                        timed(sync_post({"clear": True}, who="bob", path="/queue")))
    _, running = await comfy.queue_count()
    still = alice_pid in running
    rep.add("comfy: bob's POST /interrupt while alice's prompt runs", "answered < 0.5 s; alice's prompt keeps running",
            f"{dt_i:.2f} s, {short(res_i, 60)}; alice's prompt running after: {still}", dt_i < 0.5 and still)
    _, qa = await queued_task
    qh = await comfy.wait_done(qa.get("prompt_id", "-"), timeout=30) if isinstance(qa, dict) else None
    ok_q = bool(qh) and qh["status"]["status_str"] == "success"
    rep.add("comfy: bob's POST /queue {clear: true} while alice has a prompt queued",
            "answered < 0.5 s; alice's queued prompt still runs to success",
            f"{dt_c:.2f} s, {short(res_c, 60)}; queued prompt: {'success' if ok_q else short(qh, 60)}",
            dt_c < 0.5 and ok_q)
    await comfy.wait_idle()

    alice_pid = await busy()
    dt, res = await timed(sync_post({}, who="alice", path="/interrupt"))
    ah = await comfy.wait_done(alice_pid, timeout=1.0)
    rep.add("comfy: alice's POST /interrupt of her own running prompt", "answered < 0.5 s; prompt interrupted at once",
            f"{dt:.2f} s, {short(res, 40)}; interrupted within 1 s: {interrupted(ah)}", dt < 0.5 and interrupted(ah))
    await comfy.wait_idle()

    # 8. step_progress of a workflow with two progress-reporting nodes
    evs = await sse_job(http, g + "/prompt", {"prompt": workflow(fresh_seed(), 4, 150, progress_nodes=2)})
    pcts = [d["pct"] for e, d in evs if e == "step_progress"]
    mono = all(b >= a for a, b in itertools.pairwise(pcts))
    rep.add("comfy: step_progress, two progress nodes (4 steps each)", "pct never goes backwards, ends at 100",
            f"pct {pcts}; last event {evs[-1][0] if evs else '-'}", mono and bool(pcts) and pcts[-1] == 100)

    # 9. a failed prompt's result carries no traceback or file paths
    evs = await sse_job(http, g + "/prompt", {"prompt": failing_workflow(fresh_seed())})
    last = evs[-1] if evs else ("-", {})
    text = json.dumps(last[1])
    leaked = leaks(text)
    job_id = next((d.get("job_id") for e, d in evs if e == "queued" and isinstance(d, dict)), None)
    result_text = ""
    if job_id:
        async with http.get(f"{gw}/v1/jobs/{job_id}/result", headers=auth()) as r:
            result_text = await r.text()
        leaked += [f"result: {m}" for m in leaks(result_text)]
    keeps = "kl test failure" in text
    rep.add("comfy: failed prompt (KLFail) as sse", "failed event keeps the message, no traceback/paths",
            f"event {last[0]}; message kept: {keeps}; leaked markers: {leaked or 'none'}",
            last[0] == "failed" and keeps and not leaked)

    # 7. node killed mid-job (a second ComfyUI of our own; the check kills it)
    got = await spare()
    if got is None:
        rep.add("comfy: node killed mid-job", "job re-queued to the standby (rerouted) and completes",
                "skipped: no --comfy-dir/--comfy-python", None)
        return
    _, kill = got
    killed = asyncio.Event()

    async def on_ev(ev: str, data: Any) -> None:
        if ev == "step_progress" and not killed.is_set():
            kill()
            killed.set()

    evs = await sse_job(http, gw + "/comfykill/prompt", {"prompt": workflow(fresh_seed(), 20, 100)},
                        on_event=on_ev, timeout=90)
    names = [e for e, _ in evs]
    err = next((d.get("error") for e, d in evs if e == "failed"), None)
    rep.add("comfy: node SIGKILLed mid-job (retry_on_failover 1, standby up)", "rerouted, then output_ready",
            f"events {names[-4:]}{'; error ' + short(err, 90) if err else ''}",
            "rerouted" in names and names[-1:] == ["output_ready"])


# --- OpenAI checks ----------------------------------------------------------------------------------

async def openai_checks(http: aiohttp.ClientSession, direct: aiohttp.ClientSession, gw: str, a: argparse.Namespace,
                        proxy: V1OnlyProxy, rep: Report) -> None:
    llama = a.llama_url.rstrip("/")
    node_key = {"Authorization": f"Bearer {a.llama_key}"} if a.llama_key else {}
    client = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and a cat."}]

    async def slow_streams(n: int, tokens: int) -> list[asyncio.Task[Any]]:
        async def one() -> None:
            # A grammar makes llama.cpp test every one of the 32k tokens at every step: ~3 ms a token
            # even for a tiny model, so these streams hold their slots for a second or more.
            s = await client.chat.completions.create(model="x", messages=msgs, max_tokens=tokens, stream=True,
                                                     extra_body={"ignore_eos": True, "grammar": "root ::= [a-z ]+"})
            async for _ in s:
                pass
        return [asyncio.create_task(one()) for _ in range(n)]

    # 7. errors keep their status with stream: true (context overflow)
    huge = [{"role": "user", "content": "hello " * 3000}]
    for stream in (False, True):
        try:
            r = await client.chat.completions.create(model="x", messages=huge, max_tokens=4, stream=stream)
            if stream:
                async for _ in r:  # type: ignore[union-attr]
                    pass
            got, ok = "no error", False
        except openai.APIStatusError as e:
            got, ok = f"{type(e).__name__} status {e.status_code}", isinstance(e, openai.BadRequestError)
        except openai.APIError as e:
            got, ok = f"{type(e).__name__} (no status): {short(str(e), 80)}", False
        rep.add(f"openai: context overflow, stream={stream} (SDK)", "BadRequestError, status 400", got, ok)

    # 8. usage counted on streams without stream_options.include_usage
    async with direct.post(llama + "/v1/chat/completions", headers=node_key,
                         json={"messages": msgs, "max_tokens": 8, "ignore_eos": True}) as r:
        ref = (await r.json())["usage"]
    before = await metric(http, gw, "kiloline_tokens_total", {"route": "llm", "key": "alice"})
    s = await client.chat.completions.create(model="x", messages=msgs, max_tokens=8, stream=True,
                                             extra_body={"ignore_eos": True})
    async for _ in s:
        pass
    await asyncio.sleep(0.3)
    counted = await metric(http, gw, "kiloline_tokens_total", {"route": "llm", "key": "alice"}) - before
    rep.add("openai: tokens counted on a stream without include_usage",
            f"counted = prompt+completion = {ref['total_tokens']}", f"counted {counted:g}",
            counted >= ref["total_tokens"])

    # 9. a token budget is not overshot by requests already admitted
    carol = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEYS["carol"], max_retries=0, timeout=120)

    async def spend() -> int | str:
        try:
            r = await carol.chat.completions.create(model="x", messages=msgs, max_tokens=40,
                                                    extra_body={"ignore_eos": True})
            return r.usage.total_tokens if r.usage else 0
        except openai.APIStatusError as e:
            return f"{e.status_code}"

    res = await asyncio.gather(*(spend() for _ in range(10)))
    spent = sum(x for x in res if isinstance(x, int))
    refused = [x for x in res if isinstance(x, str)]
    rep.add(f"openai: tokens_per_day {CAROL_TOKENS_PER_DAY}, 10 concurrent requests of ~{ref['prompt_tokens'] + 40}",
            f"tokens spent <= {CAROL_TOKENS_PER_DAY}", f"spent {spent}; refused {refused}",
            spent <= CAROL_TOKENS_PER_DAY)

    # 10. models.retrieve is not queued behind busy slots
    models = await client.models.list()
    mid = models.data[0].id if models.data else "x"
    busy = await slow_streams(3, 300)
    await asyncio.sleep(0.3)
    # llama.cpp has no GET /v1/models/{id} (its 404 is the answer); what counts is that it is not queued.
    dt, res = await timed(client.models.retrieve(mid))
    still_busy = sum(not t.done() for t in busy)
    await asyncio.gather(*busy, return_exceptions=True)
    what = f"{type(res).__name__}" + (f" {res.status_code}" if isinstance(res, openai.APIStatusError) else "")
    rep.add("openai: models.retrieve while both slots stream", "answered < 0.2 s (not queued)",
            f"{dt:.2f} s -> {what}; streams still running after: {still_busy}", dt < 0.2)

    # 11. the node's 401 to the gateway is the node's fault: 502
    bad = openai.AsyncOpenAI(base_url=gw + "/bad/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    try:
        await bad.chat.completions.create(model="x", messages=msgs, max_tokens=2)
        got, st = "no error", 200
    except openai.APIStatusError as e:
        got, st = f"{type(e).__name__} status {e.status_code}: {short(e.message, 70)}", e.status_code
    rep.add("openai: wrong gateway->node key", "502 upstream_error (not the client's 401)", got, st == 502)

    # 12a. a /v1-only server (vLLM's path set) behind a prefixed route (strip_path: true, url …/v1)
    v1 = openai.AsyncOpenAI(base_url=gw + "/vllm/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    proxy.paths.clear()
    try:
        await v1.chat.completions.create(model="x", messages=msgs, max_tokens=2)
        got = "200"
    except openai.APIStatusError as e:
        got = f"{type(e).__name__} {e.status_code}"
    seen = [p for p in proxy.paths if "chat" in p]
    rep.add("openai: route /vllm/v1 (strip_path: true) -> a /v1-only server at url/v1",
            "node gets /v1/chat/completions; 200",
            f"{got}; node got {seen}", got == "200" and seen == ["/v1/chat/completions"])

    # 12b. X-KiloLine-Node on a streamed response
    async with http.post(gw + "/v1/chat/completions", headers=auth(),
                         json={"messages": msgs, "max_tokens": 4, "stream": True}) as r:
        await r.read()
        hdr = r.headers.get("X-KiloLine-Node")
    rep.add("openai: X-KiloLine-Node on a stream", "header names the node (llama)", f"{hdr!r}", hdr == "llama")


# --- the spare ComfyUI that the kill check may SIGKILL ----------------------------------------------

def spare_starter(a: argparse.Namespace, http: aiohttp.ClientSession, procs: list[subprocess.Popen],
                  dirs: list[Path]) -> Callable[[], Awaitable[tuple[str, Callable[[], None]] | None]]:
    async def start() -> tuple[str, Callable[[], None]] | None:
        if not (a.comfy_dir and a.comfy_python):
            return None
        url = f"http://127.0.0.1:{a.spare_port}"
        # Its own output/temp/input/user folders and an in-memory database: nothing shared with the main one.
        base = Path(tempfile.mkdtemp(prefix="klcheck-spare-"))
        dirs.append(base)
        p = subprocess.Popen([a.comfy_python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port",
                              str(a.spare_port), "--output-directory", str(base / "output"),
                              "--temp-directory", str(base / "temp"), "--input-directory", str(base / "input"),
                              "--user-directory", str(base), "--database-url", "sqlite:///:memory:"],
                             cwd=a.comfy_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        end = time.monotonic() + 180
        while time.monotonic() < end:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/object_info/KLSlowProgress") as r:
                    if r.status == 200 and "KLSlowProgress" in await r.text():
                        break
            await asyncio.sleep(1)
        else:
            return None
        await asyncio.sleep(2.5)  # let the gateway's health check see it up
        return url, lambda: os.kill(p.pid, signal.SIGKILL)
    return start


async def main(a: argparse.Namespace) -> int:
    rep, notes = Report(), Notes()
    procs: list[subprocess.Popen] = []
    dirs: list[Path] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        comfy = Comfy(http, a.comfy_url)
        proxy = V1OnlyProxy(a.llama_url)
        v1only_url = await proxy.start()
        spare_url = f"http://127.0.0.1:{a.spare_port}" if a.comfy_dir and a.comfy_python else None
        with tempfile.TemporaryDirectory(prefix="klcheck-") as tmp:
            srv = await start_gateway(gateway_config(a, v1only_url, spare_url), Path(tmp))
            gw = f"http://127.0.0.1:{srv.port}"
            print(f"gateway on {gw}", file=sys.stderr)
            await asyncio.sleep(1.5)  # first health checks
            try:
                if a.only in (None, "comfy"):
                    if a.observe:
                        await observe_comfy(http, comfy, notes)
                    await comfy_checks(http, gw, comfy, rep, spare_starter(a, http, procs, dirs))
                if a.only in (None, "openai"):
                    # llama-server closes its socket after every streamed answer although it sends
                    # "Keep-Alive: timeout=5": direct calls to it never reuse a connection.
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                        if a.observe:
                            await observe_llama(fresh, a, notes)
                        await openai_checks(http, fresh, gw, a, proxy, rep)
            finally:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    p.wait()
                for d in dirs:
                    shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(Exception):
                    await comfy.interrupt_all()
                await srv.shutdown()
                await proxy.stop()
    table = rep.markdown()
    print(table)
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.observe:
        Path(a.observe).write_text(re.sub(r"\n{3,}", "\n\n", notes.text()))
    failed = sum(r.ok is False for r in rep.rows)
    print(f"\n{sum(r.ok is True for r in rep.rows)} passed, {failed} failed", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--comfy-url", default="http://127.0.0.1:8188")
    p.add_argument("--llama-url", default="http://127.0.0.1:8080")
    p.add_argument("--llama-key", default="kl-node-key", help="the --api-key llama-server was started with")
    p.add_argument("--comfy-dir", help="ComfyUI source folder, to start a spare ComfyUI for the kill check")
    p.add_argument("--comfy-python", help="the python of ComfyUI's venv")
    p.add_argument("--spare-port", type=int, default=8189)
    p.add_argument("--only", choices=("comfy", "openai"))
    p.add_argument("--observe", help="write the servers' raw frames and bodies to this file")
    p.add_argument("--markdown", help="also write the table to this file")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
