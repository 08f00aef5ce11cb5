"""Cluster mode: token and GPU-second budgets counted once for every gateway, over a real
redis-server and real gateway processes (docs/CLUSTER.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

MESSAGES = [{"role": "user", "content": "say something please"}]  # a prompt estimate of 5 tokens


@pytest.fixture
async def llm() -> AsyncIterator[FakeGPU]:
    g = FakeGPU("openai", vram_gb=1000, job_vram_gb=1, step_ms=30)
    await g.start()
    yield g
    await g.stop()


pytestmark = pytest.mark.gpu(step_ms=150)


async def completion(s: aiohttp.ClientSession, gw: GatewayProc, who: str = "alice") -> tuple[int, str | None]:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 10}
    async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth(who)) as r:
        data = await r.json()
        return r.status, (data.get("error") or {}).get("type") if r.status != 200 else None


async def generate(s: aiohttp.ClientSession, gw: GatewayProc, who: str) -> tuple[int, str | None]:
    async with s.post(gw.url + "/gen/generate", json={}, headers=auth(who)) as r:
        data = await r.json()
        return r.status, (data.get("error") or {}).get("message") if r.status != 200 else None


async def usage(r: Any, key: str) -> dict[str, float]:
    day = next(iter(await r.keys(f"kl-test:bu:{key}:*")), None)
    raw = await r.hgetall(day) if day else {}
    return {f: float(raw.get(f, 0)) for f in ("requests", "tokens", "gpu")}


async def test_token_reservations_hold_across_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                                       llm: FakeGPU, tmp_path: Path) -> None:
    """Each request reserves 5 + 10 tokens at dispatch and uses 3 + 10: a budget of 60 holds four
    reservations for the whole cluster; each gateway counting alone would let through eight."""
    gateways += make_gateways(2, tmp_path, redis_server.url, llm.url, kind="openai", path="/v1",
                              max_concurrency=4)
    for g in gateways:
        g.cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 60}
    await start_all(gateways)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        got = await asyncio.gather(*(completion(s, gateways[i % 2]) for i in range(20)))
    assert sorted(st for st, _ in got) == [200] * 4 + [429] * 16, got
    assert {t for st, t in got if st == 429} == {"budget_exhausted"}
    assert len([q for q in llm.requests if q["path"] == "/v1/chat/completions"]) == 4
    r = redis_server.client()
    await until(lambda: _tokens(r, "alice", 52), "the usage never reached Redis")
    # Every reservation ended with its request: none is left held in Redis.
    await until(lambda: _no_reservation(r, "alice"), "a reservation was left in Redis")
    await r.aclose()


async def _tokens(r: Any, key: str, n: float) -> bool:
    return (await usage(r, key))["tokens"] == n


async def _no_reservation(r: Any, key: str) -> bool:
    return not await r.hgetall(f"kl-test:br:{key}")


async def test_gpu_seconds_count_once_for_the_cluster(redis_server: RedisServer, gateways: list[GatewayProc],
                                                      gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
    for g in gateways:
        g.cfg["keys"]["bob"]["budget"] = {"gpu_seconds_per_day": 0.5}
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession() as s:
        # About 0.3 s of GPU each: one through each gateway spends 0.6 of the cluster's 0.5, while
        # each gateway alone has seen only 0.3 of it.
        assert (await generate(s, a, "bob"))[0] == 200
        await until(lambda: _gpu(r, "bob", 0.25), "A's GPU seconds never reached Redis")
        assert (await generate(s, b, "bob"))[0] == 200
        await until(lambda: _gpu(r, "bob", 0.55), "B's GPU seconds never reached Redis")
        for gw in (a, b):
            st, msg = await generate(s, gw, "bob")
            assert st == 429 and msg is not None and "gpu_seconds_per_day" in msg, (st, msg)
    await r.aclose()


async def _gpu(r: Any, key: str, at_least: float) -> bool:
    return (await usage(r, key))["gpu"] >= at_least


async def test_redis_down_splits_the_remaining_budget(redis_server: RedisServer, gateways: list[GatewayProc],
                                                      gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=4)
    for g in gateways:
        g.cfg["keys"]["bob"]["budget"] = {"requests_per_day": 10}
    await start_all(gateways)
    a = gateways[0]
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(4):
            assert (await generate(s, a, "bob"))[0] == 200
        await r.aclose()
        await asyncio.sleep(1.5)  # B re-reads the cluster's count of bob (every lease_ttl_sec / 3)
        redis_server.kill()
        await until(lambda: _all_down(gateways), "a gateway never noticed Redis was gone")
        # 6 were left when Redis went: 3 for each of the two gateways, however many come to each.
        got = await asyncio.gather(*(generate(s, gateways[i % 2], "bob") for i in range(30)))
    assert sum(1 for st, _ in got[0::2] if st == 200) == 3, got
    assert sum(1 for st, _ in got[1::2] if st == 200) == 3, got


async def _all_down(gws: list[GatewayProc]) -> bool:
    return all(st["cluster"]["redis"] == "down" for st in await asyncio.gather(*(g.state() for g in gws)))
