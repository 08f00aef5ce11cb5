"""Cluster mode: a request re-queued because its node was lost waits, on every gateway, until the
node is seen alive again (the leader's health check, shared as a transition), then runs there."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all

pytestmark = pytest.mark.gpu(steps=40, step_ms=50)


async def test_requests_lost_with_their_node_run_again_once_it_is_back(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, retry_on_failover=1)
    for g in gateways:
        g.cfg["nodes"]["gpu"]["health"] = {"interval_sec": 0.3, "timeout_sec": 0.5, "fall": 2, "rise": 1}
    await start_all(gateways)
    async with aiohttp.ClientSession() as s:

        async def one(gw: GatewayProc) -> tuple[int, str]:
            async with s.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
                return r.status, await r.text()

        reqs = [asyncio.ensure_future(one(g)) for g in gateways]  # one on the leader, one not
        deadline = asyncio.get_running_loop().time() + 15
        while gpu.stats["running"] < 2:
            assert asyncio.get_running_loop().time() < deadline, gpu.stats
            await asyncio.sleep(0.02)
        await gpu.kill()
        await asyncio.sleep(1.5)
        await gpu.revive()
        results = await asyncio.wait_for(asyncio.gather(*reqs), 40)
    assert [st for st, _ in results] == [200, 200], results
    assert gpu.stats["served"] == 2
