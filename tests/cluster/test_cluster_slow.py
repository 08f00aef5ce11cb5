"""Slow nodes in cluster mode (SPEC §14, docs/CLUSTER.md "Shared node state"): a real redis-server,
real gateway processes and three simulated GPUs on one route, one of them slow. The soft eject
(one slot, ranked last), the hard eject (breaker open), the trial and the recovery are one state for
the cluster: every gateway acts on them, the leader alone alerts, and a gateway that starts later
reads them from Redis."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import ADMIN, auth
from fakes import FakeTelegram

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, cluster_config, free_port, start_all, until

TOKEN = "123456:ABC-slow-cluster"
SLOW = {"samples": 4, "evaluations": 2, "min_gap_ms": 1}
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "max_open_sec": 120, "slow_start_sec": 0}
JOB = {"steps": 4, "step_ms": 15}  # ~60 ms on a healthy card: the gateways' overhead stays small beside it


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as f:
        yield f


@pytest.fixture
async def cards() -> AsyncIterator[dict[str, FakeGPU]]:
    """a and b at full speed, c 2.5× slower (``kilolined fakegpu --slowdown 2.5``)."""
    made = {n: FakeGPU("generic", vram_gb=1000, job_vram_gb=1, steps=4, step_ms=15, crash_sec=0.5,
                       slowdown=2.5 if n == "c" else 1.0) for n in "abc"}
    for g in made.values():
        await g.start()
    yield made
    for g in made.values():
        await g.stop()


def config(redis_url: str, cards: dict[str, FakeGPU], gid: str, tg: FakeTelegram, *, slow: Any = SLOW,
           breaker: dict[str, Any] = BREAKER) -> dict[str, Any]:
    cfg = cluster_config(redis_url, "http://unused", free_port(), gid, ttl=1.5, max_concurrency=2,
                         retry_on_failover=2)
    cfg["nodes"] = {n: {"url": g.url, "slow": copy.deepcopy(slow), "breaker": dict(breaker)} for n, g in cards.items()}
    cfg["routes"]["gen"]["nodes"] = list(cards)
    cfg["notify"] = {"telegram": {"bot_token": TOKEN, "chat_id": "-1001", "api_base": tg.url},
                     "group_sec": 0.1, "min_interval_sec": 0}
    return cfg


async def two(redis: RedisServer, cards: dict[str, FakeGPU], tg: FakeTelegram, procs: list[GatewayProc],
              tmp: Path, **kw: Any) -> list[GatewayProc]:
    """Two gateways on the same file (each its own id and port), started and agreed on a leader."""
    procs += [GatewayProc(config(redis.url, cards, f"gw{i}", tg, **kw), tmp / f"gw{i}.yaml") for i in range(2)]
    await start_all(procs)
    await until(lambda: leader_known(procs), "no leader")
    return list(procs)


async def leader_known(gws: list[GatewayProc]) -> bool:
    seen = [st["cluster"]["leader"] for st in await asyncio.gather(*(g.state() for g in gws))]
    return seen[0] is not None and len(set(seen)) == 1


async def leader_and_other(gws: list[GatewayProc]) -> tuple[GatewayProc, GatewayProc]:
    lead = (await gws[0].state())["cluster"]["leader"]
    a, b = gws
    return (a, b) if a.cfg["cluster"]["gateway_id"] == lead else (b, a)


async def load(s: aiohttp.ClientSession, gw: GatewayProc, stop: asyncio.Event, seen: list[int]) -> None:
    while not stop.is_set():
        async with s.post(gw.url + "/gen/generate", json=JOB, headers=auth()) as r:
            await r.read()
            seen.append(r.status)


class Load:
    """``n`` clients per gateway, each sending one request after another until stopped."""

    def __init__(self, s: aiohttp.ClientSession, gws: list[GatewayProc], n: int):
        self.stop = asyncio.Event()
        self.seen: list[int] = []
        self.tasks = [asyncio.create_task(load(s, g, self.stop, self.seen)) for g in gws for _ in range(n)]

    async def end(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        assert set(self.seen) <= {200}, self.seen

    async def more(self, n: int, timeout: float = 30) -> None:
        want = len(self.seen) + n
        await until(lambda: _true(len(self.seen) >= want), f"fewer than {n} more requests served", timeout=timeout)


async def _true(v: bool) -> bool:
    return v


async def node(gw: GatewayProc, name: str = "c") -> dict[str, Any]:
    return (await gw.state())["nodes"][name]


async def on_all(gws: list[GatewayProc], pred: Any, name: str = "c") -> bool:
    return all(pred(n) for n in await asyncio.gather(*(node(g, name) for g in gws)))


def lines(tg: FakeTelegram, text: str) -> list[str]:
    return [line for m in tg.messages for line in m["text"].splitlines() if text in line]


async def settle() -> None:
    """Several group windows and node-state sweeps: a second alert or a lagging state would show."""
    await asyncio.sleep(1.2)


async def test_a_soft_eject_is_one_state_for_the_cluster(redis_server: RedisServer, gateways: list[GatewayProc],
                                                         cards: dict[str, FakeGPU], tg: FakeTelegram,
                                                         tmp_path: Path) -> None:
    gws = await two(redis_server, cards, tg, gateways, tmp_path)
    c = cards["c"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        busy = Load(s, gws, 4)  # more than a, b and c's one slot take: some always wait
        try:
            await until(lambda: on_all(gws, lambda n: n["slowed"]), "c was not soft-ejected on both gateways",
                        timeout=30)
            for n in await asyncio.gather(*(node(g) for g in gws)):
                assert n["slots"] == 1 and n["breaker"] == "closed"
                assert n["speed"]["state"] == "slow", n["speed"]
            # Exactly N, and N is 1 now: never one slot here and another there — nor while a third
            # gateway joins (its first heartbeat writes its view of the slots into Redis).
            await until(lambda: _true(c.stats["running"] <= 1), "c still runs what it held before", timeout=10)
            c.reset()
            late = GatewayProc(config(redis_server.url, cards, "gw2", tg), tmp_path / "gw2.yaml")
            gateways.append(late)
            late.start()
            await late.ready()
            await busy.more(60)
            assert c.stats["max_concurrent"] <= 1 and c.stats["served"] > 0, c.stats
            assert max(cards[n].stats["max_concurrent"] for n in "ab") <= 2
        finally:
            await busy.end()
        # The gateway started after the eject read it from Redis: no transition reached it.
        late_c = await node(late)
        assert late_c["slowed"] and late_c["slots"] == 1 and late_c["speed"]["state"] == "slow", late_c
        # Ranked last on every gateway: with room on a and b, c is not chosen.
        await until(lambda: _true(c.stats["running"] == 0), "c never finished", timeout=10)
        c.reset()
        calm = Load(s, gws[:1], 2)
        calm.tasks.append(asyncio.create_task(load(s, gws[1], calm.stop, calm.seen)))
        try:
            await calm.more(45)
        finally:
            await calm.end()
        assert c.stats["served"] <= 2, (c.stats["served"], len(calm.seen))
        await settle()
        slow = lines(tg, "c slow:")
        assert len(slow) == 1, tg.messages  # one voice for the cluster
        assert "ms/request vs" in slow[0] and "1 slot until it recovers" in slow[0]

        # `slow: off` by reload, on every gateway: lifted everywhere, and stays off under load.
        for g in gateways:
            for n in g.cfg["nodes"].values():
                n["slow"] = False
            g.path.write_text(yaml.safe_dump(g.cfg))
            async with s.post(g.url + "/admin/reload", headers=ADMIN) as r:
                assert r.status == 200, await r.text()
        await until(lambda: on_all(gateways, lambda n: not n["slowed"] and n["slots"] == 2),
                    "slow: off did not lift the eject on every gateway", timeout=10)
        r = redis_server.client()
        try:  # and Redis keeps no verdict a gateway that turns it on again would take (the lift is
            # published as the reload makes it: a moment after the reload's answer, not a sweep later)
            async def lifted_in_redis() -> bool:
                return await r.hmget("kl-test:node:c", ["slow", "slowed"]) == ["ok", "0"]
            await until(lifted_in_redis, "Redis still holds the verdict `slow: off` lifted", timeout=3)
            await asyncio.sleep(0.5)  # and no gateway publishes it again
            assert await lifted_in_redis()
        finally:
            await r.aclose()
        busy = Load(s, gateways, 2)
        try:
            await busy.more(40)
        finally:
            await busy.end()
        assert await on_all(gateways, lambda n: not n["slowed"] and n["speed"] is None)


async def test_the_leader_alerts_what_another_gateway_saw(redis_server: RedisServer, gateways: list[GatewayProc],
                                                          cards: dict[str, FakeGPU], tg: FakeTelegram,
                                                          tmp_path: Path) -> None:
    """Every request goes through the gateway that is not the leader: the leader measures nothing,
    yet the eject and the recovery are alerted, once each, by it (the one voice)."""
    gws = await two(redis_server, cards, tg, gateways, tmp_path,
                    breaker={**BREAKER, "open_sec": 2, "max_open_sec": 4})
    lead, other = await leader_and_other(gws)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        busy = Load(s, [other], 6)
        try:
            await until(lambda: _true(bool(lines(tg, "c slow:"))), "no node_slow alert from the leader", timeout=30)
            assert (await node(lead))["slowed"] or (await node(lead))["speed"]["state"] == "slow"
            cards["c"].slowdown = 1.0  # the neighbour left: back to speed
            await until(lambda: _true(bool(lines(tg, "c back to speed"))), "no node_recovered alert", timeout=30)
        finally:
            await busy.end()
    # (the leader measured nothing: no numbers of its own, and no verdict left)
    await until(lambda: on_all(gws, lambda n: not n["slowed"] and (n["speed"] or {"state": "ok"})["state"] == "ok"),
                "the recovery did not reach the leader", timeout=10)
    await settle()
    assert len(lines(tg, "c slow:")) == 1 and len(lines(tg, "c back to speed")) == 1, tg.messages


async def test_a_hard_eject_opens_the_breaker_on_both(redis_server: RedisServer, gateways: list[GatewayProc],
                                                      cards: dict[str, FakeGPU], tg: FakeTelegram,
                                                      tmp_path: Path) -> None:
    cards["c"].slowdown = 6.0  # beyond 3× its peers: out at once
    gws = await two(redis_server, cards, tg, gateways, tmp_path)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        busy = Load(s, gws, 3)
        try:
            await until(lambda: on_all(gws, lambda n: n["breaker"] == "open"), "the breaker did not open on both",
                        timeout=30)
            await until(lambda: _true(cards["c"].stats["running"] == 0), "c never finished", timeout=10)
            cards["c"].reset()
            await busy.more(30)
            assert cards["c"].stats["served"] == 0  # open on both: neither sends it anything
        finally:
            await busy.end()
    await settle()
    assert len(lines(tg, "c slow:")) == 1, tg.messages
    assert len([x for x in lines(tg, "c breaker OPEN") if "slow" in x]) == 1, tg.messages


async def test_a_stall_seen_through_one_gateway_opens_the_breaker_on_both(
        redis_server: RedisServer, gateways: list[GatewayProc], tg: FakeTelegram, tmp_path: Path) -> None:
    llm, spare = FakeGPU("openai", step_ms=20), FakeGPU("openai", step_ms=20)
    await llm.start()
    await spare.start()
    try:
        for i in range(2):
            cfg = cluster_config(redis_server.url, llm.url, free_port(), f"gw{i}", ttl=1.5, kind="openai",
                                 path="/v1", max_concurrency=1, retry_on_failover=0)
            # a standby that can take work: gpu is not the route's last node, so a stall ejects it
            cfg["nodes"]["spare"] = {"url": spare.url}
            cfg["routes"]["gen"]["standby"] = ["spare"]
            for n in ("gpu", "spare"):
                cfg["nodes"][n].update(slow={"stall_sec": 0.4}, breaker=BREAKER)
            cfg["notify"] = {"telegram": {"bot_token": TOKEN, "chat_id": "-1001", "api_base": tg.url},
                             "group_sec": 0.1, "min_interval_sec": 0}
            gateways.append(GatewayProc(cfg, tmp_path / f"gw{i}.yaml"))
        await start_all(gateways)
        await until(lambda: leader_known(gateways), "no leader")
        _lead, other = await leader_and_other(gateways)
        llm.set_control(drip_ms=1500)  # each piece of the answer 1.5 s after the last: a stall
        body = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello there"}], "stream": True,
                "max_tokens": 8}
        async with aiohttp.ClientSession() as s, s.post(other.url + "/v1/chat/completions", json=body,
                                                        headers=auth()) as r:
            text = await r.text()
        # 502, or 200 when a queued comment went out first: then the error comes in the stream
        assert r.status in (200, 502) and "stalled: no byte from the node" in text, (r.status, text)
        await until(lambda: on_all(gateways, lambda n: n["breaker"] == "open", "gpu"),
                    "the breaker is not open on both")
        for g in gateways:
            assert (await node(g, "gpu"))["speed"]["state"] == "stalled"
        await until(lambda: _true(bool(lines(tg, "gpu stalled:"))), "no node_slow alert from the leader")
        await settle()
        assert len(lines(tg, "gpu stalled:")) == 1, tg.messages
        assert len(lines(tg, "gpu breaker OPEN after a stall")) == 1, tg.messages
    finally:
        await llm.stop()
        await spare.stop()
