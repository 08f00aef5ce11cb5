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
from aiohttp import web
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until


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
    # Nothing left waiting or leased (a release reaches Redis just after its response went out).
    await until(lambda: _idle(r), "Redis still counts a lease or a waiting request")
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


class AlertSink:
    """A local receiver for the notify webhook: every event name the gateways sent."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            body = await request.json()
            self.events += [e["event"] for e in body["events"]]
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/hook", hook)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook"  # type: ignore[union-attr]


@pytest.fixture
async def alerts() -> AsyncIterator[AlertSink]:
    a = AlertSink()
    await a.start()
    yield a
    assert a.runner is not None
    await a.runner.cleanup()


async def instance_of(r: Any, gid: str) -> str:
    return next(m for m in await r.zrange("kl-test:gw", 0, -1) if m.startswith(gid + "#"))


async def test_kill9_of_a_gateway_mid_burst(redis_server: RedisServer, gateways: list[GatewayProc],
                                            gpu: FakeGPU, tmp_path: Path) -> None:
    ttl = 2.0
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, ttl=ttl)
    await start_all(gateways)
    r = redis_server.client()
    dead = await instance_of(r, "gw2")

    async def quiet(s: aiohttp.ClientSession, gw: GatewayProc) -> int:
        try:
            return (await post(s, gw, "carol", steps=2, step_ms=100))[0]
        except aiohttp.ClientError:
            return -1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        live = [asyncio.create_task(post(s, gateways[i % 2], ("alice", "bob")[i % 2], steps=2, step_ms=100))
                for i in range(40)]
        doomed = [asyncio.create_task(quiet(s, gateways[2])) for _ in range(20)]
        # The victim holds a slot of the node when it dies.
        await until(lambda: _holds(r, dead), "gw2 never held a lease")
        gateways[2].kill9()
        killed_at = time.monotonic()
        await until(lambda: _gone(r, dead), "the dead gateway's leases were never given back", timeout=6 * ttl)
        reaped_after = time.monotonic() - killed_at
        done = await asyncio.gather(*live)
        await asyncio.gather(*doomed)
    assert [st for st, _ in done] == [200] * 40
    assert gpu.stats["max_concurrent"] <= 2
    # Reaped by the heartbeat TTL, not by luck: the bound is lease_ttl_sec plus one renewal period.
    assert reaped_after <= ttl + ttl / 3 + 1.5, reaped_after
    await until(lambda: _idle(r), "a lease was never given back in Redis")
    await r.aclose()


async def _idle(r: Any) -> bool:
    return (int(await r.get("kl-test:n:gen") or 0) == 0
            and all(int(v) == 0 for v in (await r.hgetall("kl-test:nin")).values()))


async def _holds(r: Any, inst: str) -> bool:
    return int(await r.scard(f"kl-test:gl:{inst}")) > 0


async def _gone(r: Any, inst: str) -> bool:
    return await r.zscore("kl-test:gw", inst) is None


async def test_redis_killed_mid_burst_splits_then_restores(redis_server: RedisServer, gateways: list[GatewayProc],
                                                           gpu: FakeGPU, alerts: AlertSink, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=2)
    for g in gateways:
        g.cfg["notify"] = {"webhook": {"url": alerts.url}, "group_sec": 0.1, "min_interval_sec": 0}
    await start_all(gateways)
    r = redis_server.client()
    await until(lambda: _count(r, 2), "both gateways registered")
    await r.aclose()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        burst = [asyncio.create_task(post(s, gateways[i % 2], ("alice", "bob")[i % 2], steps=2, step_ms=50))
                 for i in range(60)]
        while gpu.stats["served"] < 5:
            await asyncio.sleep(0.01)
        redis_server.kill()
        # A lease held at the moment of the loss runs on (100 ms here) even on a gateway over its
        # share; from then on each gateway alone starts work only under its share (1 of 2).
        await asyncio.sleep(0.5)
        gpu.reset()
        done = await asyncio.gather(*burst)
        assert [st for st, _ in done] == [200] * 60
        assert gpu.stats["served"] > 10  # the burst went on while Redis was down
        assert gpu.stats["max_concurrent"] <= 2
        await until(lambda: _has(alerts, "cluster_degraded"), "no cluster_degraded alert")
        redis_server.start()
        r = redis_server.client()
        await until(lambda: _count(r, 2), "the gateways never came back to Redis")
        await until(lambda: _has(alerts, "cluster_restored"), "no cluster_restored alert")
        # Each gateway notices within lease_ttl_sec / 3; until then it keeps to its share.
        await until(lambda: _all_up(gateways), "a gateway never re-registered")
        gpu.reset()
        again = await asyncio.gather(*(post(s, gateways[i % 2], "alice") for i in range(40)))
        assert [st for st, _ in again] == [200] * 40
        assert gpu.stats["max_concurrent"] == 2  # the full N again, shared
        assert int(await r.get("kl-test:n:gen") or 0) == 0
        await r.aclose()
    await asyncio.sleep(0.5)
    assert alerts.events.count("cluster_degraded") == 1, alerts.events
    assert alerts.events.count("cluster_restored") == 1, alerts.events


async def _count(r: Any, n: int) -> bool:
    try:
        return int(await r.zcard("kl-test:gw")) >= n
    except Exception:
        return False


async def _all_up(gws: list[GatewayProc]) -> bool:
    return all(st["cluster"]["redis"] == "up" for st in await asyncio.gather(*(g.state() for g in gws)))


async def _has(alerts: AlertSink, event: str) -> bool:
    return event in alerts.events


async def test_shared_bucket_and_budget_admit_exactly_b(redis_server: RedisServer, gateways: list[GatewayProc],
                                                         gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, max_concurrency=4)
    for g in gateways:
        g.cfg["keys"]["alice"]["rate"] = {"per_minute": 0.001, "burst": 10}  # no refill within the test
        g.cfg["keys"]["bob"]["budget"] = {"requests_per_day": 10}
    await start_all(gateways)

    async def status(s: aiohttp.ClientSession, gw: GatewayProc, who: str) -> tuple[int, str | None]:
        async with s.post(gw.url + "/gen/generate", json={}, headers=auth(who)) as r:
            body = await r.json()
            return r.status, (body.get("error") or {}).get("type") if r.status != 200 else None

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for who, refusal in (("alice", "rate_limited"), ("bob", "budget_exhausted")):
            got = await asyncio.gather(*(status(s, gateways[i % 3], who) for i in range(200)))
            assert sum(1 for st, _ in got if st == 200) == 10, (who, got)
            assert {(st, t) for st, t in got if st != 200} == {(429, refusal)}
