"""Cluster mode end to end: a real redis-server, real gateway processes on loopback ports, a
fake GPU that records its maximum concurrency (docs/CLUSTER.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cluster_harness import GatewayProc, RedisServer, gateways, make_gateways, redis_server, start_all
from conftest import auth

from kilolined.fakegpu import FakeGPU

__all__ = ["gateways", "redis_server"]  # fixtures


@pytest.fixture
async def gpu() -> AsyncIterator[FakeGPU]:
    # Plenty of VRAM: the card never crashes, it only counts how many jobs ran at once.
    g = FakeGPU("generic", vram_gb=1000, job_vram_gb=1, steps=2, step_ms=20, crash_sec=0.4)
    await g.start()
    yield g
    await g.stop()


async def post(s: aiohttp.ClientSession, gw: GatewayProc, who: str = "alice", **body: Any) -> tuple[int, float]:
    async with s.post(gw.url + "/gen/generate", json=body, headers=auth(who)) as r:
        await r.read()
        return r.status, time.monotonic()


async def test_exactly_n_across_three_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                               gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        results = await asyncio.gather(*(post(s, gateways[i % 3], ("alice", "bob", "carol")[i % 3])
                                         for i in range(600)))
    assert [st for st, _ in results] == [200] * 600
    stats = gpu.stats
    # Each gateway alone would release its own 2: three times the node's N.
    assert stats["max_concurrent"] == 2
    assert stats["served"] == 600
    r = redis_server.client()
    assert int(await r.get("kl-test:n:gen") or 0) == 0  # nothing left waiting
    assert all(int(v) == 0 for v in (await r.hgetall("kl-test:nin")).values())  # nothing left leased
    await r.aclose()


async def test_fair_order_holds_across_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                                gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        alice = [asyncio.create_task(post(s, a, "alice", steps=2, step_ms=50)) for _ in range(100)]
        # Alice's 100 are queued in Redis before Bob's one arrives on the other gateway.
        deadline = time.monotonic() + 20
        while int(await r.get("kl-test:n:gen") or 0) < 98:
            assert time.monotonic() < deadline, "alice's requests never queued in Redis"
            await asyncio.sleep(0.02)
        status, bob_done = await post(s, b, "bob", steps=2, step_ms=50)
        done = await asyncio.gather(*alice)
    await r.aclose()
    assert status == 200 and all(st == 200 for st, _ in done)
    # Round-robin across keys: at most the 2 running and 1 more of Alice's go before Bob's.
    before_bob = sum(1 for _, t in done if t < bob_done)
    assert before_bob <= 4, before_bob
    assert gpu.stats["max_concurrent"] == 2
