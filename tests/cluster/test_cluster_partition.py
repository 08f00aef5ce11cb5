"""Partitions: exactly N whoever loses Redis (docs/CLUSTER.md "What happens when something fails").

One gateway cut off from Redis while the other two still reach it goes on alone with its share;
Redis keeps that share reserved for it meanwhile, so the node never runs more than N. When the
partition heals, the gateway registers again: its reservation goes, and the grants Redis made
for its tickets while it could not hear them are handed back at once, not after
request_timeout_sec. Three gateways on a real redis-server, the middle one behind a TCP relay
that can be severed, in front of a fake node that counts what it runs at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, Relay, make_gateways, start_all, until

N = 4
TTL = 1.5
PREFIX = "kl-test:"
STEP_MS = 100
STEPS = 8  # 0.8 s a request


@pytest.fixture
async def relay(redis_server: RedisServer) -> AsyncIterator[Relay]:
    r = Relay(redis_server.port)
    await r.start()
    yield r
    await r.stop()


async def send(s: aiohttp.ClientSession, gw: GatewayProc, kind: str) -> int:
    if kind == "openai":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": STEPS}
        url = gw.url + "/v1/chat/completions"
    else:
        body, url = {"steps": STEPS, "step_ms": STEP_MS}, gw.url + "/gen/generate"
    async with s.post(url, json=body, headers=auth()) as r:
        await r.read()
        return r.status


async def redis_settled(redis_server: RedisServer) -> bool:
    """Nothing in doubt, nothing counted on the node, no share reserved: every slot came back."""
    r = redis_server.client()
    try:
        nin = await r.hgetall(PREFIX + "nin")
        return (not await r.smembers(PREFIX + "dn") and all(int(v) == 0 for v in nin.values())
                and not await r.hgetall(PREFIX + "lost"))
    finally:
        await r.aclose()


async def cluster_of(gw: GatewayProc) -> dict[str, Any]:
    return dict((await gw.state())["cluster"])


@pytest.mark.parametrize("kind", ["openai", "generic"])
async def test_a_partial_partition_runs_no_more_than_n_and_its_healing_blocks_no_slot(
        redis_server: RedisServer, relay: Relay, gateways: list[GatewayProc], tmp_path: Path, kind: str) -> None:
    # openai: a llama.cpp node, which shows its slots (a reaped lease is freed as soon as it is
    # free there); generic: a node that can tell nothing (one would wait request_timeout_sec).
    gpu = FakeGPU(kind, vram_gb=1000, job_vram_gb=1, steps=STEPS, step_ms=STEP_MS, crash_sec=0.4)
    await gpu.start()
    try:
        route: dict[str, Any] = {"kind": kind, "max_concurrency": N, "request_timeout_sec": 600}
        if kind == "openai":
            route["path"] = "/v1"
        gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, ttl=TTL, **route)
        cut = gateways[1]  # gw1: a share of 1 (gw0 has 2, gw2 1)
        cut.cfg["cluster"]["redis_url"] = relay.url
        await start_all(gateways)
        done: Counter[str] = Counter()
        stop = asyncio.Event()

        async def client(s: aiohttp.ClientSession, gw: GatewayProc) -> None:
            while not stop.is_set():
                assert await send(s, gw, kind) == 200
                done[gw.cfg["cluster"]["gateway_id"]] += 1

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # Three clients on each gateway: N = 4 is always full, and each gateway has tickets waiting.
            load = [asyncio.ensure_future(client(s, g)) for g in gateways for _ in range(3)]
            await until(lambda: _running(gpu, N), "the node never filled up")
            relay.sever()
            await until(lambda: _redis_is(cut, "down"), "the cut-off gateway never noticed")
            lost = await _lost_on(gateways[0])
            # Its share of N = 4 over three gateways (gw0 has 2, gw1 and gw2 1 each), and of a capacity.
            assert [g["reserved"] for g in lost] == [{"routes": {"gen": 1}, "nodes": {},
                                                      "capacity": pytest.approx(1 / 3)}]
            before = done["gw1"]
            await until(lambda: _done_at_least(done, "gw1", before + 4), "the cut-off gateway never ran alone", 30)
            relay.heal()
            await until(lambda: _redis_is(cut, "up"), "the cut-off gateway never came back")
            again = done["gw1"]
            await until(lambda: _done_at_least(done, "gw1", again + 2), "the healed gateway never ran again", 30)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*load), 60)
        assert gpu.stats["max_concurrent"] <= N, gpu.stats
        # Every slot comes back: the healed gateway's reservation and the grants it never heard
        # of go when it registers again — long before request_timeout_sec (600 s).
        await until(lambda: redis_settled(redis_server), "a slot stayed blocked after the partition healed", 3 * TTL)
    finally:
        await gpu.stop()


async def _running(gpu: FakeGPU, n: int) -> bool:
    return bool(gpu.stats["running"] >= n)


async def _redis_is(gw: GatewayProc, want: str) -> bool:
    return (await cluster_of(gw))["redis"] == want


async def _lost_on(gw: GatewayProc) -> list[dict[str, Any]]:
    """The lost gateways ``gw`` shows, once there is one (the cut-off one's heartbeat lapsed)."""
    async def some() -> bool:
        return bool((await cluster_of(gw))["lost"])
    await until(some, "the cut-off gateway was never shown lost", 20)
    lost = (await cluster_of(gw))["lost"]
    assert [g["id"] for g in lost] == ["gw1"], lost
    return list(lost)


async def _done_at_least(done: Counter[str], gid: str, n: int) -> bool:
    return done[gid] >= n
