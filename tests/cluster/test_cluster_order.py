"""Cluster mode: the priority strategy (with its aging) and drop_oldest over the waiting requests
of every gateway, with a real redis-server and two gateway processes (docs/CLUSTER.md)."""

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

pytestmark = pytest.mark.gpu(steps=1, step_ms=50)


async def post(s: aiohttp.ClientSession, gw: GatewayProc, who: str, **body: Any) -> tuple[int, str | None, float]:
    async with s.post(gw.url + "/gen/generate", json=body, headers=auth(who)) as r:
        data = await r.json()
        err = (data.get("error") or {}).get("type") if r.status != 200 else None
        return r.status, err, time.monotonic()


async def waiting(r: Any, n: int) -> bool:
    return int(await r.get("kl-test:n:gen") or 0) == n


async def test_priority_with_aging_across_gateways(redis_server: RedisServer, gateways: list[GatewayProc],
                                                   gpu: FakeGPU, tmp_path: Path) -> None:
    """One slot, held 5 s. Alice (priority 0) waits on A from the start; Carol (1) and Bob (5)
    come to B 3.5 s later. Aging is +1 per queue_timeout_sec / 4 = 2 s: when the slot frees Alice
    has waited ~4.7 s (2 + 0) and Carol ~1.5 s (0 + 1), so Bob goes first, then Alice, then Carol.
    FIFO would be Alice, Carol, Bob; priority without aging Bob, Carol, Alice."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, strategy="priority", max_concurrency=1,
                              queue_timeout_sec=8)
    for g in gateways:
        g.cfg["keys"]["carol"]["priority"] = 1
        g.cfg["keys"]["bob"]["priority"] = 5
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        started = time.monotonic()
        blocker = asyncio.create_task(post(s, a, "alice", steps=1, step_ms=5000))
        await until(lambda: _leased(r), "the blocker never took the slot")
        alice = asyncio.create_task(post(s, a, "alice"))
        await until(lambda: waiting(r, 1), "alice never queued")
        await asyncio.sleep(3.5 - (time.monotonic() - started))
        carol = asyncio.create_task(post(s, b, "carol"))
        bob = asyncio.create_task(post(s, b, "bob"))
        await until(lambda: waiting(r, 3), "carol and bob never queued")
        done = {who: await t for who, t in (("alice", alice), ("carol", carol), ("bob", bob))}
        assert (await blocker)[0] == 200
    await r.aclose()
    assert all(st == 200 for st, _, _ in done.values()), done
    order = sorted(done, key=lambda who: done[who][2])
    assert order == ["bob", "alice", "carol"], order


async def _leased(r: Any) -> bool:
    return int((await r.hgetall("kl-test:nin")).get("gpu", 0)) == 1


async def test_drop_oldest_drops_the_clusters_oldest(redis_server: RedisServer, gateways: list[GatewayProc],
                                                     gpu: FakeGPU, tmp_path: Path) -> None:
    """Depth 2, both places taken on A: a request on B drops A's oldest, which fails 503 queue_full."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1, max_queue_depth=2,
                              drop_policy="drop_oldest")
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        blocker = asyncio.create_task(post(s, a, "alice", steps=1, step_ms=1500))
        await until(lambda: _leased(r), "the blocker never took the slot")
        oldest = asyncio.create_task(post(s, a, "alice"))
        await until(lambda: waiting(r, 1), "the first never queued")
        second = asyncio.create_task(post(s, a, "alice"))
        await until(lambda: waiting(r, 2), "the second never queued")
        newest = asyncio.create_task(post(s, b, "bob"))
        st, err, _ = await oldest
        assert (st, err) == (503, "queue_full")  # answered while the slot is still held
        assert not blocker.done()
        assert (await second)[0] == 200
        assert (await newest)[0] == 200
        assert (await blocker)[0] == 200
    await until(lambda: waiting(r, 0), "a ticket was left waiting in Redis")
    assert await r.zcard("kl-test:w:gen") == 0
    await r.aclose()


async def test_max_queued_per_key_counts_keys_under_fifo(redis_server: RedisServer, gateways: list[GatewayProc],
                                                         gpu: FakeGPU, tmp_path: Path) -> None:
    """One FIFO for the route, but max_queued_per_key still counts each client key apart."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, strategy="fifo", max_concurrency=1,
                              max_queued_per_key=1)
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        blocker = asyncio.create_task(post(s, a, "carol", steps=1, step_ms=1000))
        await until(lambda: _leased(r), "the blocker never took the slot")
        alice = asyncio.create_task(post(s, a, "alice"))
        await until(lambda: waiting(r, 1), "alice never queued")
        second = await post(s, b, "alice")
        bob = asyncio.create_task(post(s, b, "bob"))
        assert second[:2] == (429, "queue_full")  # alice's second, on the other gateway
        assert [(await t)[0] for t in (alice, bob, blocker)] == [200, 200, 200]
    await r.aclose()


async def test_positions_and_depths_are_cluster_wide(redis_server: RedisServer, gateways: list[GatewayProc],
                                                     gpu: FakeGPU, tmp_path: Path) -> None:
    """Alice queues 3 on A, Bob 1 on B (fifo_fair_lease): Bob's async job is 2nd in the cluster's
    order, and both gateways show the cluster's 4 waiting, by key."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1)
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        blocker = asyncio.create_task(post(s, a, "carol", steps=1, step_ms=2500))
        await until(lambda: _leased(r), "the blocker never took the slot")
        alice = [asyncio.create_task(post(s, a, "alice", steps=1, step_ms=300)) for _ in range(3)]
        await until(lambda: waiting(r, 3), "alice never queued")
        async with s.post(b.url + "/gen/generate", json={}, headers={**auth("bob"), "Prefer": "respond-async"}) as resp:
            assert resp.status == 202
            job = await resp.json()
        assert job["position"] == 2  # alice's 1st, then bob's: round-robin over the keys
        for gw in (a, b):
            await until(lambda gw=gw: _route_is(gw, 4, {"alice": 3, "bob": 1}), "a gateway's view is not the cluster's")
        async with s.get(b.url + f"/v1/jobs/{job['job_id']}", headers=auth("bob")) as resp:
            assert (await resp.json())["position"] == 2
        assert (await blocker)[0] == 200
        await asyncio.gather(*alice)
    await r.aclose()


async def _route_is(gw: GatewayProc, depth: int, by_key: dict[str, int]) -> bool:
    rt = (await gw.state())["routes"]["gen"]
    return rt["queue_depth"] == depth and rt["waiting_by_key"] == by_key
