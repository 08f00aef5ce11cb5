"""Affinity end to end (SPEC §13): the real daemon over loopback in front of small llama.cpp-like
servers that keep a prompt cache and report it as llama.cpp does (``timings.cache_n``/``prompt_n``,
``usage.prompt_tokens_details.cached_tokens``), on the JSON answer and on the last SSE chunk."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from conftest import ADMIN, auth, base_config, wait_until

DOC_TOKENS = 100  # what one document costs a node to prefill


class Llama:
    """One fake llama-server: remembers the system prompts (documents) it has prefilled."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.docs: list[str] = []  # the document of every completion it served, in order
        self.healthy = True
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
        return web.Response(status=200 if self.healthy else 503)

    async def chat(self, r: web.Request) -> web.StreamResponse:
        body = orjson.loads(await r.read())
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


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        doc: dict[str, Any] = await r.json()
        return doc


async def test_follow_ups_go_where_the_document_is_and_the_reuse_shows(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kilolined.access")
    servers = await llamas(3)
    gw = await gateway(config(servers))
    for round_ in range(4):
        for doc in range(3):
            await ask(http, gw.url, chat(doc, f"question {round_}?", stream=round_ % 2 == 1))
    # Every document stayed on one node: each node prefilled it once, then reused it.
    for doc in range(3):
        holders = [s for s in servers if any(d.startswith(f"{doc}: ") for d in s.docs)]
        assert len(holders) == 1, [len(s.docs) for s in servers]
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="miss") == 3
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 9
    cached = sum(value(text, "kiloline_prompt_tokens_total", route="gen", node=f"n{i}", cached="true")
                 for i in range(3))
    computed = sum(value(text, "kiloline_prompt_tokens_total", route="gen", node=f"n{i}", cached="false")
                   for i in range(3))
    assert (cached, computed) == (9 * DOC_TOKENS, 3 * (DOC_TOKENS + 5) + 9 * 5)  # streamed ones counted too
    state = await admin_state(http, gw.url)
    route = state["routes"]["gen"]
    assert route["affinity"] == "prefix"
    assert {n for n, k in route["index_keys"].items() if k > 0} == {f"n{i}" for i, s in enumerate(servers) if s.docs}
    assert route["prompt_tokens"] == {"cached": int(cached), "total": int(cached + computed)}
    lines = [r.getMessage() for r in caplog.records if r.name == "kilolined.access"]
    assert sum(" affinity=miss" in ln and " cached=0" in ln for ln in lines) == 3, lines
    assert sum(" affinity=hit" in ln and f" cached={DOC_TOKENS}" in ln for ln in lines) == 9, lines


async def test_a_node_that_lost_the_prefix_is_a_misprediction_and_its_keys_go(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    gw = await gateway(config(servers))
    await ask(http, gw.url, chat(1, "first?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    servers[holder].held.clear()  # its prompt cache was evicted behind the gateway's back
    await ask(http, gw.url, chat(1, "second?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_mispredictions_total", route="gen", node=f"n{holder}") == 1
    # The document's keys were dropped there: the next request for it is a miss, not a hit.
    await ask(http, gw.url, chat(1, "third?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="miss") == 2
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 1


async def test_a_node_that_goes_down_forgets_its_index(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    for n in cfg["nodes"].values():
        n["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 1, "fall": 1, "rise": 1}
    gw = await gateway(cfg)
    await wait_until(lambda: all(ns.healthy for ns in gw.rt.scheduler.nodes.values()))
    await ask(http, gw.url, chat(1, "q?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    assert gw.rt.scheduler.index_keys(f"n{holder}") > 0
    servers[holder].healthy = False
    await wait_until(lambda: gw.rt.scheduler.index_keys(f"n{holder}") == 0)
    assert not gw.rt.scheduler.nodes[f"n{holder}"].healthy


async def test_session_affinity_sticks_by_header_or_user(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(3)
    gw = await gateway(config(servers, affinity="session"))
    for doc in range(4):  # different prompts, one session: one node
        await ask(http, gw.url, chat(doc, "q?"), **{"X-Session-Id": "s-1"})
    assert sorted(len(s.docs) for s in servers) == [0, 0, 4]
    for doc in range(4):
        await ask(http, gw.url, {**chat(doc, "q?"), "user": "u-9"})
    assert max(len(s.docs) for s in servers) in (4, 8) and sum(len(s.docs) for s in servers) == 8
    assert sorted(len(s.docs) for s in servers) in ([0, 0, 8], [0, 4, 4])
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 8


async def test_affinity_is_switched_live_on_reload(llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    cfg["routes"]["gen"]["affinity"] = "off"
    gw = await gateway(cfg)
    await ask(http, gw.url, chat(1, "q?"))
    assert "kiloline_affinity_decisions_total{" not in await metrics(http, gw.url)
    cfg["routes"]["gen"]["affinity"] = "prefix"
    cfg["routes"]["gen"]["affinity_block_bytes"] = 64
    gw.write_config(cfg)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    assert (await admin_state(http, gw.url))["routes"]["gen"]["affinity"] == "prefix"
    await ask(http, gw.url, chat(2, "q?"))
    await ask(http, gw.url, chat(2, "again?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 1
