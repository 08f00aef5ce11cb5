"""A frozen gateway that wakes gives its slots back (docs/CLUSTER.md "What happens when something fails").

Frozen (SIGSTOP) past ``lease_ttl_sec``, a gateway is reaped and its leases stay in doubt: on a
node that can tell nothing they would wait for ``request_timeout_sec``. When it wakes, its first
heartbeat learns it was reaped and stops those requests; a heartbeat later their slots are free,
as a restarted gateway's are — not ten minutes later on an idle node.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

N = 2


async def send(s: aiohttp.ClientSession, gw: GatewayProc, steps: int) -> int:
    async with s.post(gw.url + "/gen/generate", json={"steps": steps, "step_ms": 100}, headers=auth()) as r:
        await r.read()
        return r.status


async def test_a_woken_gateways_slots_on_a_node_that_cannot_tell_come_back(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    gpu = FakeGPU("generic", vram_gb=1000, job_vram_gb=1)
    await gpu.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=1, max_concurrency=N,
                                  request_timeout_sec=600)
        await start_all(gateways)
        frozen, other = gateways
        assert frozen.proc is not None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # Long enough to still run on the node when the gateway wakes, past its reaping.
            mine = [asyncio.ensure_future(send(s, frozen, 100)) for _ in range(N)]
            await until(lambda: _running(gpu, N), "the frozen gateway's requests never ran")
            frozen.proc.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: _alone(other), "the frozen gateway was never reaped")
                theirs = [asyncio.ensure_future(send(s, other, 1)) for _ in range(N)]
            finally:
                frozen.proc.send_signal(signal.SIGCONT)
            # Woken, it stops its requests; their slots come back long before request_timeout_sec.
            assert await asyncio.wait_for(asyncio.gather(*theirs), 20) == [200] * N
            assert [await m for m in mine] == [502] * N  # "lease lost"
        assert gpu.stats["max_concurrent"] <= N, gpu.stats
    finally:
        await gpu.stop()


async def _running(gpu: FakeGPU, n: int, exactly: bool = False) -> bool:
    running = int(gpu.stats["running"])
    return running == n if exactly else running >= n


async def _alone(gw: GatewayProc) -> bool:
    return not (await gw.state())["cluster"]["peers"]
