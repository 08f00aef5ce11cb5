"""Two fake llama.cpp nodes behind a gateway with prefix affinity, and the requests and metrics the
affinity tests read."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from conftest import ADMIN, auth, base_config

DOC_TOKENS = 100  # what one document costs a node to prefill


class Llama:
    """One fake llama-server: remembers the system prompts (documents) it has prefilled."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.docs: list[str] = []  # the document of every completion it served, in order
        self.healthy = True
        self.failing = False  # answers 500 to completions
        self.started = 1_000_000.0  # the unix time its process started, told on /health as uptime
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def health(self, _r: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "uptime": time.time() - self.started},
                                 status=200 if self.healthy else 503)

    async def chat(self, r: web.Request) -> web.StreamResponse:
        body = orjson.loads(await r.read())
        if self.failing:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        doc = body["messages"][0]["content"]
        self.docs.append(doc)
        cache_n = DOC_TOKENS if doc in self.held else 0
        self.held.add(doc)
        prompt_n = DOC_TOKENS + 5 - cache_n
        timings = {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": 2,
                   "prompt_per_second": 1000.0, "predicted_per_second": 50.0}
        usage = {"prompt_tokens": cache_n + prompt_n, "completion_tokens": 2, "total_tokens": cache_n + prompt_n + 2,
                 "prompt_tokens_details": {"cached_tokens": cache_n}}
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                                      "usage": usage, "timings": timings})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        await resp.write(b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n')
        last = {"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": timings}
        if (body.get("stream_options") or {}).get("include_usage"):
            last["usage"] = usage
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        return resp

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def llamas() -> AsyncIterator[Callable[[int], Awaitable[list[Llama]]]]:
    made: list[Llama] = []

    async def make(n: int) -> list[Llama]:
        out = [Llama() for _ in range(n)]
        for s in out:
            await s.start()
        made.extend(out)
        return out

    yield make
    for s in made:
        await s.stop()


def config(servers: list[Llama], **route: Any) -> dict[str, Any]:
    names = [f"n{i}" for i in range(len(servers))]
    cfg = base_config({n: s.url for n, s in zip(names, servers, strict=True)},
                      **{"kind": "openai", "path": "/v1", "affinity": "prefix", "max_concurrency": 2, **route})
    cfg["routes"]["gen"]["nodes"], cfg["routes"]["gen"]["standby"] = names, []
    return cfg


def chat(doc: int, question: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "stream": stream,
            "messages": [{"role": "system", "content": f"{doc}: a long document " * 60},
                         {"role": "user", "content": question}]}


async def ask(http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str) -> None:
    async with http.post(url + "/v1/chat/completions", json=body, headers={**auth(), **headers}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        return await r.text()


def value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0
