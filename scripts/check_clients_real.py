#!/usr/bin/env python3
"""Real clients through the gateway, against a real llama.cpp ``llama-server`` (docs/BACKENDS.md
"Real clients through the gateway"; SPEC §19's "what it must deliver").

Starts one llama-server (one slot, the tiny random-weight GGUF of docs/BACKENDS.md) and a gateway
in this process on loopback, with ``max_concurrency: 1`` so that a request sent while another runs
waits in the gateway's queue. Then drives the gateway with the clients people use, unchanged:

- the ``openai`` SDK: chat (sync and stream) queued behind a running request, an alias
  (``gpt-4o-mini`` -> the served model) answered under the client's name, and the errors: 401 bad
  key, 429 rate limit, 503 queue timeout, 404 model_not_found, each raised as its own exception;
- the ``anthropic`` SDK: messages create and stream, queued, and the same errors;
- LiteLLM (``--litellm-python``: a Python with ``litellm`` installed; run as a subprocess):
  completion sync and stream, and an error;
- guidellm (``--guidellm``: its CLI; run as a subprocess): a tiny synchronous benchmark;
- with ``--comfy URL`` (a running ComfyUI): ``images.generate`` (openai SDK) over a template of
  ComfyUI's own weight-free nodes (EmptyImage -> SaveImage), b64_json and url, and the route's
  ``/v1/models`` listing the template.

Prints a table (check, observed, PASS/FAIL); exit status 0 only when every check passed.

    .venv/bin/python scripts/check_clients_real.py \\
        --llama-server $REAL_DIR/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \\
        --model $REAL_DIR/llama/tiny.gguf --litellm-python /tmp/litellm-venv/bin/python \\
        --guidellm /tmp/guidellm-venv/bin/guidellm [--markdown table.md]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kilolined.core.config import parse_config
from kilolined.edge.server import Server

KEY = "kl_clients_real_check_key_00000000000"
LIMITED = "kl_clients_limited_check_key_000000000"
LIMITED2 = "kl_clients_limited2_check_key_00000000"  # the anthropic checks' own bucket
BAD = "kl_not_a_key_of_this_gateway_0000000000"
ADMIN = "kl_clients_admin_check_key_0000000000"
SERVED = "kiloline-tiny"
ALIAS = "gpt-4o-mini"
# A GBNF grammar makes the tiny model test every token at each step: a few ms per token, so a
# "hold" request keeps the one slot long enough for another to queue behind it.
GRAMMAR = "root ::= [ -~]+"
CLOUD_KEY, CLOUD_NAME, OVERFLOW_WAIT = "kl-cloud-node-key", "cloud-tiny", 2
# A workflow of ComfyUI's own weight-free nodes (no checkpoint needed): a solid image of the
# request's size, n of them, its color the request's seed.
BLANK = {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
         "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "klclients"}}}
BLANK_INPUTS = {"width": "1.inputs.width", "height": "1.inputs.height", "n": "1.inputs.batch_size",
                "seed": "1.inputs.color"}


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool]] = []

    def add(self, check: str, observed: str, ok: bool) -> None:
        self.rows.append((check, observed, ok))
        print(f"[{'PASS' if ok else 'FAIL'}] {check}: {observed}", file=sys.stderr, flush=True)

    def markdown(self) -> str:
        out = ["| check | observed | result |", "| --- | --- | --- |"]
        for check, observed, ok in self.rows:
            cells = [c.replace("|", "\\|").replace("\n", " ") for c in (check, observed)]
            out.append(f"| {cells[0]} | {cells[1]} | {'PASS' if ok else 'FAIL'} |")
        return "\n".join(out)


def gateway_config(llama_url: str, cloud_url: str, comfy: dict[str, Any] | None) -> dict[str, Any]:
    health = {"path": "/health", "interval_sec": 1}
    one = {"kind": "openai", "max_concurrency": 1, "request_timeout_sec": 120}
    # `models: discover`: the gateway reads the server's /v1/models, so a model it does not serve is
    # 404 model_not_found (llama.cpp itself answers any name with its one model).
    nodes: dict[str, Any] = {"llama": {"url": llama_url, "health": health, "models": "discover"},
                             # the same server under another name, for a route whose queue times out;
                             # the route's prefix is cut and the node's url carries /v1
                             "llama-short": {"url": llama_url + "/v1", "health": {"path": "/models",
                                                                                   "interval_sec": 1}}}
    # A second llama-server plays a hosted API: its own key (the client's never leaves the gateway)
    # and its own name for the model.
    nodes["llama-ovf"] = {"url": llama_url + "/v1", "health": {"path": "/models", "interval_sec": 1}}
    nodes["cloud"] = {"url": cloud_url + "/v1", "headers": {"Authorization": f"Bearer {CLOUD_KEY}"},
                      "rewrite": {"model": {SERVED: CLOUD_NAME}}, "price_per_mtok": {"input": 0.1, "output": 0.4},
                      "health": {"path": "/models", "interval_sec": 1}}
    routes: dict[str, Any] = {
        "llm": {**one, "path": "/v1", "nodes": ["llama"], "queue_timeout_sec": 60,
                "rewrite": {"model": {ALIAS: SERVED}}},
        "short": {**one, "path": "/short/v1", "nodes": ["llama-short"], "queue_timeout_sec": 1,
                  "strip_path": True},
        "ovf": {**one, "path": "/ovf/v1", "nodes": ["llama-ovf"], "queue_timeout_sec": 60, "strip_path": True,
                "overflow": {"nodes": ["cloud"], "when_wait_sec": OVERFLOW_WAIT}},
    }
    if comfy is not None:
        nodes["comfy"] = {"url": comfy["url"], "health": {"path": "/system_stats", "interval_sec": 1}}
        routes["comfy"] = {"kind": "comfyui", "path": "/comfy", "nodes": ["comfy"], "max_concurrency": 1,
                           "queue_timeout_sec": 300, "request_timeout_sec": 300,
                           "templates": {"blank": {"workflow": comfy["workflow"], "inputs": BLANK_INPUTS}}}
    return {"server": {"listen": "127.0.0.1:0", "heartbeat_sec": 1, "shutdown_grace_sec": 2, "access_log": False},
            "admin": {"key_sha256": sha(ADMIN), "public_metrics": True},
            "keys": {"client": {"key_sha256": sha(KEY), "routes": ["*"]},
                     "limited": {"key_sha256": sha(LIMITED), "routes": ["*"], "rate": {"per_minute": 1, "burst": 1}},
                     "limited2": {"key_sha256": sha(LIMITED2), "routes": ["*"], "rate": {"per_minute": 1, "burst": 1}}},
            "nodes": nodes, "routes": routes}


async def start_gateway(cfg: dict[str, Any], workdir: Path) -> Server:
    path = workdir / "kiloline.yaml"
    text = yaml.safe_dump(cfg)
    path.write_text(text)
    srv = Server(parse_config(text, env={}), sha(text), str(path), watch=False)
    await srv.start()
    return srv


async def wait_up(http: aiohttp.ClientSession, url: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            async with http.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 in {timeout} s")


class Hold:
    """A long streamed request that keeps the route's one slot while a check's request queues."""

    def __init__(self, http: aiohttp.ClientSession, base: str, max_tokens: int = 600):
        self.http, self.base, self.max_tokens = http, base, max_tokens
        self.started = asyncio.Event()
        self.last_byte = 0.0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        body = {"model": SERVED, "messages": [{"role": "user", "content": "hold the slot"}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "grammar": GRAMMAR, "ignore_eos": True}
        async with self.http.post(self.base + "/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}) as r:
            async for _ in r.content:
                self.started.set()  # the first bytes: it holds the slot now
                self.last_byte = time.monotonic()
        self.started.set()

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def queued_behind(self, first_at: float) -> bool:
        """A stream whose first content came after this one's last byte waited for its slot (the
        route has one): a queued stream's 200 and keep-alives go out at once, so it has no
        X-KiloLine-Queue-Wait-Ms header to show it."""
        return first_at >= self.last_byte

    async def __aenter__(self) -> Hold:
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.started.wait(), 60)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        await self.task


def wait_ms(headers: Any) -> float:
    v = headers.get("x-kiloline-queue-wait-ms")
    return float(v) if v is not None else -1.0


async def check(table: Table, name: str, fn: Callable[[], Awaitable[tuple[str, bool]]]) -> None:
    try:
        observed, ok = await fn()
    except Exception as e:  # a check's own failure is its row, not the end of the run
        observed, ok = f"{type(e).__name__}: {str(e)[:200]}", False
        traceback.print_exc()
    table.add(name, observed, ok)


def raises(exc: type[BaseException]) -> Callable[[Callable[[], Awaitable[Any]]], Awaitable[tuple[str, bool]]]:
    async def run(call: Callable[[], Awaitable[Any]]) -> tuple[str, bool]:
        try:
            await call()
        except Exception as e:
            status = getattr(e, "status_code", None)
            return f"{type(e).__name__} (HTTP {status}): {str(e)[:220]}", isinstance(e, exc)
        return "no exception", False
    return run


# --- openai SDK ------------------------------------------------------------------------------------

async def openai_checks(table: Table, http: aiohttp.ClientSession, gw: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "Say hello"}]

    async def chat_queued() -> tuple[str, bool]:
        async with Hold(http, gw + "/v1"):
            raw = await sdk.chat.completions.with_raw_response.create(model=SERVED, messages=msgs, max_tokens=8)
        got = raw.parse()
        waited = wait_ms(raw.headers)
        text = got.choices[0].message.content or ""
        return (f"model={got.model} waited={waited:.0f} ms text={len(text)} chars "
                f"usage={got.usage and got.usage.total_tokens}",
                got.model == SERVED and waited > 50 and bool(text))

    async def stream_queued() -> tuple[str, bool]:
        async with Hold(http, gw + "/v1") as hold:
            chunks, models, first_at, usage = [], set(), 0.0, None
            opened_while_busy = hold.running()
            stream = await sdk.chat.completions.create(model=SERVED, messages=msgs, max_tokens=8, stream=True,
                                                       stream_options={"include_usage": True})
            async for c in stream:
                models.add(c.model)
                if c.choices and c.choices[0].delta.content:
                    first_at = first_at or time.monotonic()
                    chunks.append(c.choices[0].delta.content)
                usage = c.usage or usage
        queued = opened_while_busy and hold.queued_behind(first_at)
        return (f"queued={queued}, {len(chunks)} content chunks, models={sorted(models)}, "
                f"usage={usage and usage.completion_tokens}",
                queued and bool(chunks) and models == {SERVED} and usage is not None)

    async def alias() -> tuple[str, bool]:
        got = await sdk.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=8)
        chunks = [c async for c in await sdk.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=8,
                                                                        stream=True)]
        listed = [m.id async for m in sdk.models.list()]
        models = {c.model for c in chunks}
        return (f"answer model={got.model}, stream models={sorted(models)}, /v1/models={listed}",
                got.model == ALIAS and models == {ALIAS} and ALIAS in listed and SERVED in listed)

    await check(table, "openai: chat, queued behind a running request", chat_queued)
    await check(table, "openai: chat stream, queued", stream_queued)
    await check(table, f"openai: alias {ALIAS} -> {SERVED}, answered as {ALIAS}", alias)

    bad = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=BAD, max_retries=0)
    limited = openai.AsyncOpenAI(base_url=gw + "/v1", api_key=LIMITED, max_retries=0)
    short = openai.AsyncOpenAI(base_url=gw + "/short/v1", api_key=KEY, max_retries=0)

    def create(c: openai.AsyncOpenAI, model: str = SERVED, stream: bool = False) -> Callable[[], Awaitable[Any]]:
        async def call() -> Any:
            r = await c.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=stream)
            if stream:
                async for _ in r:  # type: ignore[union-attr]
                    pass
        return call

    async def rate() -> tuple[str, bool]:
        await create(limited)()  # the bucket's one token
        return await raises(openai.RateLimitError)(create(limited))

    async def queue_timeout() -> tuple[str, bool]:
        async with Hold(http, gw + "/short/v1", max_tokens=1000):
            return await raises(openai.InternalServerError)(create(short))

    async def queue_timeout_stream() -> tuple[str, bool]:
        async with Hold(http, gw + "/short/v1", max_tokens=1000):
            return await raises(openai.APIError)(create(short, stream=True))

    await check(table, "openai: 401 bad key -> AuthenticationError",
                lambda: raises(openai.AuthenticationError)(create(bad)))
    await check(table, "openai: 401 bad key, stream -> AuthenticationError",
                lambda: raises(openai.AuthenticationError)(create(bad, stream=True)))
    await check(table, "openai: 429 rate limit -> RateLimitError", rate)
    await check(table, "openai: 503 queue timeout -> InternalServerError", queue_timeout)
    await check(table, "openai: queue timeout in a stream -> APIError", queue_timeout_stream)
    await check(table, "openai: 404 model_not_found -> NotFoundError",
                lambda: raises(openai.NotFoundError)(create(sdk, model="no-such-model")))
    await check(table, "openai: 404 model_not_found, stream -> NotFoundError",
                lambda: raises(openai.NotFoundError)(create(sdk, model="no-such-model", stream=True)))
    for c in (sdk, bad, limited, short):
        await c.close()


# --- overflow to a "cloud" node ------------------------------------------------------------------

async def overflow_checks(table: Table, http: aiohttp.ClientSession, gw: str, cloud_url: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=gw + "/ovf/v1", api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "Say hello"}]

    async def ask() -> tuple[str, str, float]:
        raw = await sdk.chat.completions.with_raw_response.create(model=SERVED, messages=msgs, max_tokens=8)
        return raw.headers.get("x-kiloline-node", "?"), raw.parse().model, wait_ms(raw.headers)

    async def cloud_needs_its_key() -> tuple[str, bool]:
        async with http.post(cloud_url + "/v1/chat/completions", json={"model": CLOUD_NAME, "messages": msgs},
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
            return f"the cloud server, asked with the client's key: HTTP {r.status}", r.status == 401

    async def free() -> tuple[str, bool]:
        node, model, waited = await ask()
        return f"node={node} model={model} waited={waited:.0f} ms", node == "llama-ovf" and model == SERVED

    async def within() -> tuple[str, bool]:
        async with Hold(http, gw + "/ovf/v1", max_tokens=150):  # well under the bound
            node, model, waited = await ask()
        return f"node={node} model={model} waited={waited:.0f} ms", node == "llama-ovf" and waited > 0

    async def beyond() -> tuple[str, bool]:
        async with Hold(http, gw + "/ovf/v1", max_tokens=1800):  # several times the bound
            node, model, waited = await ask()
        return (f"node={node} model={model} (the cloud's own name is {CLOUD_NAME}) waited={waited:.0f} ms",
                node == "cloud" and model == SERVED)

    await check(table, "overflow: the cloud node refuses the client's key (it has its own)", cloud_needs_its_key)
    await check(table, "overflow: a free primary takes the request", free)
    await check(table, f"overflow: a wait under when_wait_sec {OVERFLOW_WAIT} stays on the primary", within)
    await check(table, f"overflow: a wait beyond when_wait_sec {OVERFLOW_WAIT} goes to the cloud node, "
                       "answered under the client's name", beyond)
    await sdk.close()


# --- anthropic SDK ---------------------------------------------------------------------------------

async def anthropic_checks(table: Table, http: aiohttp.ClientSession, gw: str) -> None:
    # The SDK posts to {base_url}/v1/messages and sends its key as X-Api-Key.
    sdk = anthropic.AsyncAnthropic(base_url=gw, api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "Say hello"}]

    async def create_queued() -> tuple[str, bool]:
        async with Hold(http, gw + "/v1"):
            raw = await sdk.messages.with_raw_response.create(model=SERVED, max_tokens=8, messages=msgs)
        got = await raw.parse()
        text = "".join(b.text for b in got.content if b.type == "text")
        waited = wait_ms(raw.headers)
        return (f"model={got.model} waited={waited:.0f} ms text={len(text)} chars usage=in {got.usage.input_tokens}/"
                f"out {got.usage.output_tokens}", waited > 50 and bool(text) and got.usage.output_tokens > 0)

    async def stream_queued() -> tuple[str, bool]:
        async with Hold(http, gw + "/v1") as hold:
            # A queued stream gets its 200 at once and Anthropic's `event: ping` while it waits.
            opened_while_busy, kinds, first_at = hold.running(), [], 0.0
            async with sdk.messages.stream(model=SERVED, max_tokens=8, messages=msgs) as s:
                async for ev in s:
                    kinds.append(ev.type)
                    if ev.type == "text":
                        first_at = first_at or time.monotonic()
                final = await s.get_final_message()
        texts = kinds.count("text")
        queued = opened_while_busy and hold.queued_behind(first_at)
        return (f"queued={queued}, events {sorted(set(kinds))}, {texts} text deltas, stop={final.stop_reason}, "
                f"usage out={final.usage.output_tokens}", queued and texts > 0 and final.usage.output_tokens > 0)

    async def alias() -> tuple[str, bool]:
        got = await sdk.messages.create(model=ALIAS, max_tokens=8, messages=msgs)
        return f"model={got.model}", got.model == ALIAS

    await check(table, "anthropic: messages.create, queued", create_queued)
    await check(table, "anthropic: messages.stream, queued", stream_queued)
    await check(table, f"anthropic: alias {ALIAS}, answered as {ALIAS}", alias)

    bad = anthropic.AsyncAnthropic(base_url=gw, api_key=BAD, max_retries=0)
    limited = anthropic.AsyncAnthropic(base_url=gw, api_key=LIMITED2, max_retries=0)
    short = anthropic.AsyncAnthropic(base_url=gw + "/short", api_key=KEY, max_retries=0)

    def create(c: anthropic.AsyncAnthropic, model: str = SERVED, stream: bool = False) -> Callable[[], Awaitable[Any]]:
        async def call() -> Any:
            if stream:
                async with c.messages.stream(model=model, max_tokens=4, messages=msgs) as s:
                    async for _ in s:
                        pass
            else:
                await c.messages.create(model=model, max_tokens=4, messages=msgs)
        return call

    async def rate() -> tuple[str, bool]:
        await create(limited)()
        return await raises(anthropic.RateLimitError)(create(limited))

    async def queue_timeout() -> tuple[str, bool]:
        async with Hold(http, gw + "/short/v1", max_tokens=1000):
            return await raises(anthropic.InternalServerError)(create(short))

    async def queue_timeout_stream() -> tuple[str, bool]:
        # the 200 went out while queued: the timeout comes as `event: error`, which the SDK raises
        async with Hold(http, gw + "/short/v1", max_tokens=1000):
            return await raises(anthropic.APIStatusError)(create(short, stream=True))

    await check(table, "anthropic: 401 bad key -> AuthenticationError",
                lambda: raises(anthropic.AuthenticationError)(create(bad)))
    await check(table, "anthropic: 401 bad key, stream -> AuthenticationError",
                lambda: raises(anthropic.AuthenticationError)(create(bad, stream=True)))
    await check(table, "anthropic: 429 rate limit -> RateLimitError", rate)
    await check(table, "anthropic: 503 queue timeout -> InternalServerError", queue_timeout)
    await check(table, "anthropic: queue timeout in a stream (event: error) -> APIStatusError", queue_timeout_stream)
    await check(table, "anthropic: 404 model_not_found -> NotFoundError",
                lambda: raises(anthropic.NotFoundError)(create(sdk, model="no-such-model")))
    await check(table, "anthropic: 404 model_not_found, stream -> NotFoundError",
                lambda: raises(anthropic.NotFoundError)(create(sdk, model="no-such-model", stream=True)))
    for c in (sdk, bad, limited, short):
        await c.close()


# --- LiteLLM and guidellm, each from its own Python ------------------------------------------------

LITELLM = r"""
import json, sys, litellm
base, key, bad, model = sys.argv[1:5]
out = {}
r = litellm.completion(model="openai/" + model, api_base=base, api_key=key, max_tokens=8,
                       messages=[{"role": "user", "content": "Say hello"}])
out["sync"] = {"model": r.model, "text_chars": len(r.choices[0].message.content or ""),
               "total_tokens": r.usage.total_tokens}
chunks = [c for c in litellm.completion(model="openai/" + model, api_base=base, api_key=key, max_tokens=8,
                                        stream=True, messages=[{"role": "user", "content": "Say hello"}])]
out["stream"] = {"chunks": len(chunks),
                 "text_chars": len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))}
for name, k, m in (("bad_key", bad, model), ("no_model", key, "no-such-model")):
    try:
        litellm.completion(model="openai/" + m, api_base=base, api_key=k, max_tokens=4, num_retries=0,
                           messages=[{"role": "user", "content": "x"}])
        out[name] = {"exception": None}
    except Exception as e:
        out[name] = {"exception": type(e).__name__, "status": getattr(e, "status_code", None)}
out["version"] = __import__("importlib.metadata").metadata.version("litellm")
print(json.dumps(out))
"""


async def run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, "", "timed out"
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def litellm_checks(table: Table, python: str, gw: str) -> None:
    rc, out, err = await run([python, "-c", LITELLM, gw + "/v1", KEY, BAD, ALIAS], 300)
    if rc != 0:
        table.add("litellm: completion", f"exit {rc}: {err.strip()[-300:]}", False)
        return
    got = json.loads(out.strip().splitlines()[-1])
    v = got["version"]
    table.add(f"litellm {v}: completion (alias {ALIAS})", json.dumps(got["sync"]),
              got["sync"]["text_chars"] > 0 and got["sync"]["total_tokens"] > 0)
    table.add(f"litellm {v}: completion stream", json.dumps(got["stream"]),
              got["stream"]["chunks"] > 1 and got["stream"]["text_chars"] > 0)
    table.add(f"litellm {v}: bad key -> AuthenticationError", json.dumps(got["bad_key"]),
              got["bad_key"]["exception"] == "AuthenticationError")
    table.add(f"litellm {v}: unknown model -> NotFoundError", json.dumps(got["no_model"]),
              got["no_model"]["exception"] == "NotFoundError")


async def guidellm_checks(table: Table, guidellm: str, gw: str, workdir: Path) -> None:
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write about {w}.", "output_tokens_count": 8}) + "\n"
                            for w in ("rivers", "lanterns", "harbors", "copper", "meadows")))
    report = workdir / "guidellm.json"
    cmd = [guidellm, "run", "--backend", f"kind=openai_http,target={gw}/v1,api_key={KEY},model={SERVED}",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=5",
           "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    rc, out, err = await run(cmd, 300)
    if rc != 0 or not report.exists():
        table.add("guidellm: synchronous benchmark, 5 requests", f"exit {rc}: {(err or out).strip()[-400:]}", False)
        return
    text = report.read_text()
    doc = json.loads(text)
    totals = doc_totals(doc)
    table.add("guidellm: synchronous benchmark, 5 requests", totals, '"successful": 5' in totals)


def doc_totals(doc: Any) -> str:
    """The request totals of guidellm's report: successful/errored/incomplete counts."""
    found: dict[str, Any] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("request_totals", "requests_made", "request_count") and not found:
                    found[k] = v
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return json.dumps(found)[:300]


# --- ComfyUI ---------------------------------------------------------------------------------------

def png_size(png: bytes) -> tuple[int, int]:
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # IHDR width, height


async def comfy_checks(table: Table, http: aiohttp.ClientSession, gw: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=gw + "/comfy/v1", api_key=KEY, max_retries=0)

    async def generate() -> tuple[str, bool]:
        got = await sdk.images.generate(model="blank", prompt="a red fox in the snow", n=2, size="48x32",
                                        response_format="b64_json", extra_body={"seed": 255})
        pngs = [base64.b64decode(d.b64_json or "") for d in got.data or []]
        sizes = [png_size(p) for p in pngs if p.startswith(b"\x89PNG")]
        return f"{len(pngs)} PNGs, sizes {sizes}", sizes == [(48, 32), (48, 32)]

    async def by_url() -> tuple[str, bool]:
        got = await sdk.images.generate(model="blank", prompt="x", size="16x16", response_format="url")
        urls = [d.url or "" for d in got.data or []]
        pngs = []
        for u in urls:
            async with http.get(u, headers={"Authorization": f"Bearer {KEY}"}) as r:
                pngs.append(await r.read() if r.status == 200 else b"")
        sizes = [png_size(p) for p in pngs if p.startswith(b"\x89PNG")]
        return f"{len(urls)} url(s) {[u.split('?')[0] for u in urls]}, fetched sizes {sizes}", sizes == [(16, 16)]

    async def bad_value() -> tuple[str, bool]:
        return await raises(openai.BadRequestError)(
            lambda: sdk.images.generate(model="blank", prompt="x", extra_body={"seed": "lucky"}))

    async def unknown() -> tuple[str, bool]:
        return await raises(openai.NotFoundError)(lambda: sdk.images.generate(model="sdxl", prompt="x"))

    async def listed() -> tuple[str, bool]:
        ids = [m.id async for m in sdk.models.list()]
        return f"{ids}", ids == ["blank"]

    await check(table, "comfyui: images.generate n=2 b64_json (openai SDK)", generate)
    await check(table, "comfyui: images.generate response_format=url, fetched", by_url)
    await check(table, "comfyui: bad input value -> BadRequestError", bad_value)
    await check(table, "comfyui: unknown template -> NotFoundError", unknown)
    await check(table, "comfyui: GET /comfy/v1/models lists the templates", listed)
    await sdk.close()


CHECKS = ["openai", "overflow", "anthropic", "litellm", "guidellm", "comfy"]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-port", type=int, default=18431)
    ap.add_argument("--litellm-python")
    ap.add_argument("--guidellm")
    ap.add_argument("--comfy", metavar="URL", help="a running ComfyUI: check images.generate over it")
    ap.add_argument("--only", choices=CHECKS, action="append")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    only = set(a.only or CHECKS)
    workdir = Path(tempfile.mkdtemp(prefix="kl-clients-"))
    log = (workdir / "llama-server.log").open("wb")
    llama = subprocess.Popen([a.llama_server, "-m", a.model, "--alias", SERVED, "--host", "127.0.0.1",
                              "--port", str(a.llama_port), "--parallel", "1", "-c", "2048", "--threads", "1"],
                             stdout=log, stderr=subprocess.STDOUT)
    cloud_log = (workdir / "cloud-server.log").open("wb")
    cloud = subprocess.Popen([a.llama_server, "-m", a.model, "--alias", CLOUD_NAME, "--api-key", CLOUD_KEY,
                              "--host", "127.0.0.1", "--port", str(a.llama_port + 1), "--parallel", "1",
                              "-c", "2048", "--threads", "1"], stdout=cloud_log, stderr=subprocess.STDOUT)
    table = Table()
    comfy = None
    if a.comfy:
        (workdir / "blank.json").write_text(json.dumps(BLANK))
        comfy = {"url": a.comfy, "workflow": str(workdir / "blank.json")}
    srv: Server | None = None
    try:
        async with aiohttp.ClientSession() as http:
            llama_url = f"http://127.0.0.1:{a.llama_port}"
            cloud_url = f"http://127.0.0.1:{a.llama_port + 1}"
            await wait_up(http, llama_url + "/health")
            await wait_up(http, cloud_url + "/health")
            srv = await start_gateway(gateway_config(llama_url, cloud_url, comfy), workdir)
            gw = f"http://127.0.0.1:{srv.port}"
            await wait_up(http, gw + "/health")
            if "openai" in only:
                await openai_checks(table, http, gw)
            if "overflow" in only:
                await overflow_checks(table, http, gw, cloud_url)
            if "litellm" in only and a.litellm_python:
                await litellm_checks(table, a.litellm_python, gw)
            if "guidellm" in only and a.guidellm:
                await guidellm_checks(table, a.guidellm, gw, workdir)
            if "anthropic" in only:
                await anthropic_checks(table, http, gw)
            if "comfy" in only and comfy is not None:
                await comfy_checks(table, http, gw)
    finally:
        if srv is not None:
            await srv.shutdown()
        for proc in (llama, cloud):
            proc.terminate()
            proc.wait()
        log.close()
        cloud_log.close()
    md = table.markdown()
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md + "\n")
    return 0 if table.rows and all(ok for _, _, ok in table.rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
