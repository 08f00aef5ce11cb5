"""Exactly N when Redis restarts empty or stalls mid-burst (docs/CLUSTER.md, "What happens when").

Gateways on a real redis-server in front of a node that counts what it runs at once. Redis is
killed (-9, no persistence: it comes back empty) and started again mid-burst, or frozen (SIGSTOP)
past the lease TTL; the node must never run more than N, before, during or after, and every
request must be served.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

N = 3
TTL = 2.0


    # Plenty of VRAM: the card never crashes; it counts the most jobs it ran at once.
pytestmark = pytest.mark.gpu(step_ms=100)


async def post(s: aiohttp.ClientSession, gw: GatewayProc, who: str) -> int:
    async with s.post(gw.url + "/gen/generate", json={}, headers=auth(who)) as r:
        body = await r.read()
        assert r.status == 200, (gw.url, r.status, body[:300])
        return r.status


async def all_up(gws: list[GatewayProc]) -> bool:
    return all(st["cluster"]["redis"] == "up" for st in await asyncio.gather(*(g.state() for g in gws)))


async def burst_through(gws: list[GatewayProc], n: int, fault: asyncio.Future[None]) -> list[int]:
    """``n`` requests over the gateways while ``fault`` happens; their statuses."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        reqs = [asyncio.ensure_future(post(s, gws[i % len(gws)], ("alice", "bob", "carol")[i % 3]))
                for i in range(n)]
        await fault
        return list(await asyncio.wait_for(asyncio.gather(*reqs), 120))


@pytest.mark.parametrize("n_gateways", [2, 3])
async def test_redis_restarted_empty_mid_burst_never_runs_more_than_n(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path,
        n_gateways: int) -> None:
    gateways += make_gateways(n_gateways, tmp_path, redis_server.url, gpu.url, ttl=TTL, max_concurrency=N)
    await start_all(gateways)

    async def restarts() -> None:
        for round_ in range(3):  # three restarts in one burst, each at a different moment
            served = gpu.stats["served"]
            while gpu.stats["served"] < served + 6 + 3 * round_:
                await asyncio.sleep(0.01)
            redis_server.kill()
            redis_server.start()  # empty: no persistence
            await until(lambda: all_up(gateways), "a gateway never came back to Redis", timeout=30)

    statuses = await burst_through(gateways, 150, asyncio.ensure_future(restarts()))
    assert statuses == [200] * 150
    assert gpu.stats["max_concurrent"] <= N, gpu.stats


async def test_redis_frozen_past_the_ttl_never_runs_more_than_n(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, ttl=TTL, max_concurrency=N)
    await start_all(gateways)

    async def freeze() -> None:
        while gpu.stats["served"] < 8:
            await asyncio.sleep(0.01)
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(1.5 * TTL)  # every gateway's heartbeat has expired by Redis' clock
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        await until(lambda: all_up(gateways), "a gateway never came back to Redis", timeout=30)

    statuses = await burst_through(gateways, 120, asyncio.ensure_future(freeze()))
    assert statuses == [200] * 120
    assert gpu.stats["max_concurrent"] <= N, gpu.stats


async def test_a_gateway_that_never_reached_redis_takes_no_slot(
        gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    """Alone it knows no peer: taking "all of N" would add a whole N to what the others run. It
    queues (``/healthz`` says degraded) until Redis answers, then serves."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    redis = RedisServer(tmp_path)  # not started yet
    gateways += make_gateways(1, tmp_path, redis.url, gpu.url, ttl=TTL, max_concurrency=N)
    gw = gateways[0]
    gw.start()
    await gw.ready()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(gw.url + "/healthz") as r:
                assert (await r.json())["status"] == "degraded"
            reqs = [asyncio.ensure_future(post(s, gw, "alice")) for _ in range(4)]
            await asyncio.sleep(1.5 * TTL)
            assert gpu.stats["served"] == 0 and not any(r.done() for r in reqs)
            redis.start()
            assert await asyncio.wait_for(asyncio.gather(*reqs), 30) == [200] * 4
            async with s.get(gw.url + "/healthz") as r:
                assert (await r.json())["status"] == "ok"
    finally:
        redis.kill()


async def test_a_gateway_frozen_past_the_ttl_stops_its_lost_leases_when_it_wakes(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    """Frozen (SIGSTOP) past lease_ttl_sec, a gateway is reaped and its slots go to the others.
    When it wakes it must not run work on leases it no longer holds: those requests stop at once,
    with an error that says so, instead of running to their end beside the new holders."""
    slow = FakeGPU("generic", vram_gb=1000, job_vram_gb=1, steps=200, step_ms=100, crash_sec=0.4)  # 20 s each
    await slow.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, slow.url, ttl=TTL, max_concurrency=2)
        await start_all(gateways)
        frozen, other = gateways
        async with aiohttp.ClientSession() as s:

            async def one(gw: GatewayProc) -> tuple[int, bytes, float]:
                async with s.post(gw.url + "/gen/generate", json={}, headers=auth("alice")) as r:
                    return r.status, await r.read(), asyncio.get_running_loop().time()

            mine = [asyncio.ensure_future(one(frozen)) for _ in range(2)]
            await until(lambda: _running(slow, 2), "the frozen gateway's requests never ran")
            assert frozen.proc is not None
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            # Reaped: its two slots are in doubt (tests/test_cluster_doubt.py), its leases gone.
            await until(lambda: _alone(other), "the frozen gateway was never reaped", timeout=30)
            os.kill(frozen.proc.pid, signal.SIGCONT)
            woke = asyncio.get_running_loop().time()
            results = await asyncio.wait_for(asyncio.gather(*mine), 15)
            for status, body, ended in results:
                assert status == 502 and b"lease lost" in body, (status, body)
                assert ended - woke < 5 * TTL  # stopped, not run to its 20 s end
    finally:
        await slow.stop()


async def _alone(gw: GatewayProc) -> bool:
    return not (await gw.state())["cluster"]["peers"]


async def _running(gpu: FakeGPU, n: int) -> bool:
    return bool(gpu.stats["running"] >= n)
