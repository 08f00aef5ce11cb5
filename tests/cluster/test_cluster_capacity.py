"""Cluster mode: a node's capacity and the routes' costs counted once for every gateway, with
backfill and exceeds_capacity as on one gateway (real redis-server, two gateway processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

pytestmark = pytest.mark.gpu(step_ms=50)


def costed(procs: list[GatewayProc], capacity: float) -> None:
    for g in procs:
        g.cfg["nodes"]["gpu"]["capacity"] = capacity
        g.cfg["routes"]["gen"]["cost"] = {"base": 0, "per_unit": 1, "unit": "json:/size"}


async def post(s: aiohttp.ClientSession, gw: GatewayProc, who: str = "alice",
               **body: Any) -> tuple[int, str | None, float]:
    async with s.post(gw.url + "/gen/generate", json=body, headers=auth(who)) as r:
        data = await r.json()
        err = (data.get("error") or {}).get("type") if r.status != 200 else None
        return r.status, err, time.monotonic()


async def test_capacity_holds_across_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                              gpu: FakeGPU, tmp_path: Path) -> None:
    """Capacity 10, every request costs 4: two at a time on the node, whichever gateway sent them
    (each gateway counting alone would run two of its own: four)."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=10)
    costed(gateways, 10)
    await start_all(gateways)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        got = await asyncio.gather(*(post(s, gateways[i % 2], ("alice", "bob")[i % 2], size=4) for i in range(40)))
        assert [st for st, _, _ in got] == [200] * 40
        assert gpu.stats["max_concurrent"] == 2
        # A request no node could ever hold is refused at once, as on one gateway.
        assert (await post(s, gateways[1], size=11))[:2] == (422, "exceeds_capacity")
    r = redis_server.client()
    await until(lambda: _no_cost(r), "in-flight cost left in Redis")
    await r.aclose()


async def _no_cost(r: Any) -> bool:
    return not await r.hgetall("kl-test:ncost") and all(int(v) == 0 for v in (await r.hgetall("kl-test:nin")).values())


async def test_backfill_across_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                        gpu: FakeGPU, tmp_path: Path) -> None:
    """6 of 10 held on A for 1.5 s; an 8 waits at the head on A; a 2 that comes to B fits beside
    the 6 and goes first, long before the 8 can run."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=10, strategy="fifo")
    costed(gateways, 10)
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        big = asyncio.create_task(post(s, a, size=6, steps=1, step_ms=1500))
        await until(lambda: _cost(r, 6), "the 6 never took its capacity")
        head = asyncio.create_task(post(s, a, size=8))
        await until(lambda: _waiting(r, 1), "the 8 never queued")
        small = await post(s, b, "bob", size=2)
        assert small[0] == 200
        assert not big.done() and not head.done()  # the 2 went past the 8 that waits for the 6
        assert (await big)[0] == 200 and (await head)[0] == 200
    await r.aclose()


async def _cost(r: Any, n: float) -> bool:
    return float((await r.hgetall("kl-test:ncost")).get("gpu", 0)) == n


async def _waiting(r: Any, n: int) -> bool:
    return int(await r.get("kl-test:n:gen") or 0) == n
