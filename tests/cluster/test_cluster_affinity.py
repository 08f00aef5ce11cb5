"""Prefix and session affinity in cluster mode (docs/CLUSTER.md, docs/CONFIG.md#affinity): Redis
grants the node, by the rule each gateway's own index feeds it. A real redis-server, two gateway
processes, and simulated GPUs (kind openai) that keep a prompt cache and report what they reused."""

from __future__ import annotations

import asyncio
import re
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from affinity_llamas import value
from conftest import ADMIN, auth

from kilolined.fakegpu import FakeGPU
from kilolined.scheduling.affinity import prefix_affinity, rendezvous, session_affinity

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

N = 2  # each route's slots per node
WORDS = 120  # tokens of one document
# A node's prompt cache holds four requests of a document: enough for the two documents that
# affinity sends it, cycled, and far too few for the six that least-loaded leaves on one node.
CACHE_TOKENS = 4 * (WORDS + 10)


@pytest.fixture
async def gpus() -> AsyncIterator[dict[str, FakeGPU]]:
    """Three cards per route. Two jobs fit a card's VRAM; a third would crash it (out of memory)."""
    made = {f"{tag}{i}": FakeGPU("openai", steps=2, step_ms=30, vram_gb=24, job_vram_gb=10, crash_sec=0.5,
                                 prompt_cache_tokens=CACHE_TOKENS)
            for tag in ("off", "pre", "ses") for i in range(3)}
    for g in made.values():
        await g.start()
    yield made
    for g in made.values():
        await g.stop()


def configure(procs: list[GatewayProc], gpus: dict[str, FakeGPU]) -> None:
    common = {"kind": "openai", "strip_path": True, "max_concurrency": N, "queue_timeout_sec": 60,
              "request_timeout_sec": 30, "max_queue_depth": 1000, "retry_on_failover": 0}
    for g in procs:
        g.cfg["server"]["access_log"] = True
        g.cfg["nodes"] = {name: {"url": gpu.url} for name, gpu in gpus.items()}
        g.cfg["routes"] = {tag: {**common, "path": f"/{tag}", "affinity": affinity, "nodes": nodes(tag)}
                           for tag, affinity in (("off", "off"), ("pre", "prefix"), ("ses", "session"))}


def nodes(tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(3)]


def chat(doc: str, question: str, tokens: int = 2) -> dict[str, Any]:
    """A document and a question; each token the node generates takes it 30 ms."""
    text = doc + " " + " ".join(f"w{j}" for j in range(WORDS - 1))
    return {"model": "m", "max_tokens": tokens,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": question}]}


def home(route: str, doc: str) -> str:
    """Where a new prefix goes on idle nodes: the first of its rendezvous order."""
    a = prefix_affinity(route, chat(doc, "?"), 256)
    assert a is not None
    return rendezvous(a.keys[0], nodes(route))[0]


def documents(route: str, per_node: int) -> list[str]:
    """Documents whose new prefixes spread evenly, ``per_node`` to each node."""
    out: list[str] = []
    taken: Counter[str] = Counter()
    for i in range(1000):
        doc = f"doc{i}"
        if taken[home(route, doc)] < per_node:
            taken[home(route, doc)] += 1
            out.append(doc)
    assert len(out) == 3 * per_node
    return out


async def ask(s: aiohttp.ClientSession, gw: GatewayProc, route: str, body: dict[str, Any],
              **headers: str) -> tuple[str, int, int]:
    """(the node that answered, prompt tokens, prompt tokens the node reported reused)"""
    async with s.post(f"{gw.url}/{route}/v1/chat/completions", json=body, headers={**auth(), **headers}) as r:
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        return r.headers["X-KiloLine-Node"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def idle(r: Any) -> bool:
    """No lease counted in Redis: the last request's release has landed, every node is free."""
    return all(int(v) == 0 for v in (await r.hgetall("kl-test:nin")).values())


async def decisions(s: aiohttp.ClientSession, procs: list[GatewayProc], route: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for g in procs:
        async with s.get(g.url + "/metrics", headers=ADMIN) as r:
            text = await r.text()
        for outcome in ("hit", "miss", "load"):
            out[outcome] += value(text, "kiloline_affinity_decisions_total", route=route, outcome=outcome)
    return dict(out)


def logged(procs: list[GatewayProc], route: str) -> Counter[str]:
    """The access log's affinity= fields of the route's answered requests, over the gateways."""
    line = re.compile(rf" {route} {route}\d \S+ 200 .* affinity=(\w+)")
    return Counter(m.group(1) for g in procs for m in line.finditer(g.log.read_text()))


async def test_documents_land_where_either_gateway_sent_them_and_stay_cached(
        redis_server: RedisServer, gateways: list[GatewayProc], gpus: dict[str, FakeGPU], tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpus["off0"].url)
    configure(gateways, gpus)
    await start_all(gateways)
    r = redis_server.client()
    docs = documents("pre", 2)
    share: dict[str, float] = {}
    async with aiohttp.ClientSession() as s:
        for route in ("off", "pre"):
            served: dict[str, set[str]] = defaultdict(set)
            prompt = cached = 0
            for round_ in range(4):
                for i, doc in enumerate(docs):
                    # Each document through the other gateway than last time: a gateway that has
                    # never sent it anywhere must still send it where the other did.
                    node, p, c = await ask(s, gateways[(round_ + i) % 2], route, chat(doc, f"question {round_}?"))
                    served[doc].add(node)
                    prompt, cached = prompt + p, cached + c
                    await until(lambda: idle(r), "the release reached Redis")
            share[route] = cached / prompt
            if route == "pre":
                assert {doc: served[doc] for doc in docs} == {doc: {home("pre", doc)} for doc in docs}
        # Each gateway's first request for a document is a miss (its own index has nothing), its
        # second a hit; Redis chose the node, the gateway counted it when the grant landed.
        assert await decisions(s, gateways, "pre") == {"hit": 12, "miss": 12, "load": 0}
        assert logged(gateways, "pre") == {"hit": 12, "miss": 12}
        # Least-loaded (off) leaves every document on the first idle node, which cannot hold six.
        assert share["pre"] > share["off"] + 0.4, share

        # A hot document: the node that holds it takes N, the rest go elsewhere at once (affinity
        # never waits for a busy node) and no node ever runs more than N.
        hot = docs[0]
        answers = await asyncio.gather(*(ask(s, gateways[k % 2], "pre", chat(hot, f"burst {k}?", tokens=10))
                                         for k in range(12)))
        assert len({node for node, _, _ in answers}) > 1, answers
        assert all(gpus[n].stats["max_concurrent"] <= N for n in nodes("pre")), {
            n: gpus[n].stats["max_concurrent"] for n in nodes("pre")}
        assert all(gpus[n].stats["oom_count"] == 0 for n in nodes("pre"))
        after = await decisions(s, gateways, "pre")
        assert after["load"] >= 1 and sum(after.values()) == 24 + 12, after
    await until(lambda: idle(r), "every lease released")
    await r.aclose()


async def test_a_session_sticks_to_its_node_through_either_gateway(
        redis_server: RedisServer, gateways: list[GatewayProc], gpus: dict[str, FakeGPU], tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpus["ses0"].url)
    configure(gateways, gpus)
    await start_all(gateways)
    r = redis_server.client()
    sessions = [f"s-{i}" for i in range(6)]
    ring = {sid: rendezvous(session_affinity("ses", sid).keys[0], nodes("ses")) for sid in sessions}
    assert len({walk[0] for walk in ring.values()}) > 1  # sessions that least-loaded would not tell apart
    async with aiohttp.ClientSession() as s:
        for k in range(3):
            for i, sid in enumerate(sessions):
                # A different prompt every time: only the session ties them together.
                node, _, _ = await ask(s, gateways[(k + i) % 2], "ses", chat(f"turn{k}-{sid}", "?"),
                                       **{"X-Session-Id": sid})
                assert node == ring[sid][0], (sid, k)
                await until(lambda: idle(r), "the release reached Redis")
        assert await decisions(s, gateways, "ses") == {"hit": 18, "miss": 0, "load": 0}
        # One session in a burst: its node takes what the 125 % bound allows, the others the rest,
        # and no node runs more than N.
        answers = await asyncio.gather(*(ask(s, gateways[k % 2], "ses", chat(f"burst{k}", "?", tokens=10),
                                             **{"X-Session-Id": "s-0"}) for k in range(10)))
        assert len({node for node, _, _ in answers}) > 1
        assert all(gpus[n].stats["max_concurrent"] <= N for n in nodes("ses"))
    await until(lambda: idle(r), "every lease released")
    await r.aclose()
