"""Cards over two gateways on Redis (docs/CONFIG.md#cards, docs/CLUSTER.md): two servers on one
card of N, each behind its own route with more slots than the card, a burst through both
gateways to both routes: the fakes never run more than N at once together, and do reach N. The
card is one more limit of the rules (kilolined/scheduling/rules.py ``card_slots``), counted in
Redis like every other."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from conftest import auth

from kilolined.core.config import CardConfig, NodeConfig, RouteConfig
from kilolined.fakegpu import FakeGPU
from kilolined.fakegpu.card import Job
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, WAITING, RouteQueue, Scheduler
from kilolined.scheduling.share import share_of

from .harness import GatewayProc, RedisServer, make_gateways, start_all

N = 2


class Peak:
    """What the fakes run at once, together: taken at each job's start on either."""

    def __init__(self, *gpus: FakeGPU) -> None:
        self.gpus = gpus
        self.peak = 0
        for g in gpus:
            begin = g.begin_job

            def counted(vram_gb: float | None = None, begin=begin) -> Job:  # type: ignore[no-untyped-def]
                job = begin(vram_gb)
                self.peak = max(self.peak, sum(x.stats["running"] for x in self.gpus))
                return job

            g.begin_job = counted  # type: ignore[method-assign]


async def generate(s: aiohttp.ClientSession, gw: GatewayProc, route: str) -> int:
    async with s.post(f"{gw.url}/{route}/generate", json={"steps": 4, "step_ms": 30}, headers=auth()) as r:
        await r.read()
        return r.status


async def test_a_card_of_n_runs_no_more_than_n_over_two_gateways(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    a, b = FakeGPU("generic", steps=4, step_ms=30), FakeGPU("generic", steps=4, step_ms=30)
    await a.start()
    await b.start()
    try:
        peak = Peak(a, b)
        gateways += make_gateways(2, tmp_path, redis_server.url, a.url, max_concurrency=4)
        for g in gateways:
            g.cfg["nodes"] = {"a": {"url": a.url, "card": "gpu"}, "b": {"url": b.url, "card": "gpu"}}
            g.cfg["cards"] = {"gpu": {"max_concurrency": N}}
            g.cfg["routes"]["gen"]["nodes"] = ["a"]
            g.cfg["routes"]["gen2"] = {**g.cfg["routes"]["gen"], "path": "/gen2", "nodes": ["b"]}
        await start_all(gateways)
        async with aiohttp.ClientSession() as s:
            got = await asyncio.gather(*(generate(s, gateways[i % 2], "gen" if i % 4 < 2 else "gen2")
                                         for i in range(24)))
        assert got == [200] * 24
        assert peak.peak == N, f"{peak.peak} ran at once on a card of {N}"
        assert a.stats["served"] and b.stats["served"], (a.stats, b.stats)
    finally:
        await a.stop()
        await b.stop()


def alone(me: str) -> Scheduler:
    """Nodes a and b on a card of 3 slots and capacity 6, one route over both; this gateway one of
    two (gw0, gw1) that lost Redis."""
    s = Scheduler()
    s.cards.cfg["gpu"] = CardConfig(max_concurrency=3, capacity=6)
    for n in "ab":
        s.nodes[n] = NodeState(n, NodeConfig(url=f"http://10.0.0.{ord(n)}:1", card="gpu"))
    s.routes["r"] = RouteQueue("r", RouteConfig(path="/r", nodes=["a", "b"], max_concurrency=4, queue_timeout_sec=60))
    s.share = share_of(me, ["gw0", "gw1"])
    return s


def test_a_gateway_without_redis_takes_its_share_of_a_card() -> None:
    """Redis down: each gateway runs alone with its share of every slot count, a card's too
    (⌊N / k⌋, the remainder to the lowest ids; its capacity split evenly)."""
    s = alone("gw1")  # 1 of the card's 3 slots
    assert [s.admit("r", "k", 0, 0.0).state for _ in range(2)] == [LEASED, WAITING]
    s = alone("gw0")  # 2 of its slots, 3 of its capacity
    assert [s.admit("r", "k", 0, 0.0, cost=c).state for c in (2.5, 1.0)] == [LEASED, WAITING]
