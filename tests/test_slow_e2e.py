"""Slow nodes end to end (SPEC §14): a real gateway over three simulated GPUs, one of them slow
(``fakegpu --slowdown``): soft-ejected, alerted, shown, and "exactly N" held throughout."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until
from slow_fleet import BREAKER, SLOW, fleet, load


async def state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def test_a_slow_gpu_is_soft_ejected_alerted_and_shown(fakegpus, gateway, http, tg, dc) -> None:
    a, b, c, _cfg, gw = await fleet(fakegpus, gateway, tg, dc)
    stop, seen = asyncio.Event(), []
    workers = [asyncio.create_task(load(http, gw.url, stop, seen)) for _ in range(6)]
    try:
        await wait_until(lambda: gw.rt.scheduler.nodes["c"].slowed, timeout=60)
        st = (await state(http, gw.url))["nodes"]
        assert st["c"]["slowed"] is True and st["c"]["slots"] == 1
        speed = st["c"]["speed"]
        assert speed["unit"] == "ms/request" and speed["state"] == "slow"
        assert speed["ewma"] > 1.5 * speed["peers_median"]
        assert st["a"]["speed"]["state"] == "ok" and st["a"]["slots"] == 2
        # Soft: it still serves, one request at a time, ranked after the others (what it held
        # when it was ejected finishes first: nothing is taken back).
        await wait_until(lambda: len(c._running) <= 1, timeout=10)
        c.reset()
        before = len(seen)
        await wait_until(lambda: len(seen) >= before + 60, timeout=30)
        assert c.stats["max_concurrent"] <= 1, (tg.messages, gw.rt.speed.book.nodes)
        assert max(a.stats["max_concurrent"], b.stats["max_concurrent"]) <= 2
        for who in (tg, dc):
            key = "text" if who is tg else "content"
            await wait_until(lambda w=who, k=key: any("c (Spot C) slow:" in m[k] for m in w.messages), timeout=10)
        msg = next(m["text"] for m in tg.messages if "slow:" in m["text"])
        assert "ms/request vs" in msg and "on its peers" in msg and "1 slot until it recovers" in msg
        async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
            text = await r.text()
        assert 'kiloline_node_slow{node="c"} 1.0' in text and 'kiloline_node_slow{node="a"} 0.0' in text
        assert 'kiloline_node_speed{node="c",route="gen",unit="ms/request"}' in text
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert {s for s, _ in seen} == {200}
    # never the second: a and b were never ejected
    assert not gw.rt.scheduler.nodes["a"].slowed and not gw.rt.scheduler.nodes["b"].slowed


async def test_slow_off_by_reload_lifts_the_eject_and_slow_on_brings_it_back(fakegpus, gateway, http, tg, dc) -> None:
    _a, _b, _c, cfg, gw = await fleet(fakegpus, gateway, tg, dc)
    stop, seen = asyncio.Event(), []
    workers = [asyncio.create_task(load(http, gw.url, stop, seen)) for _ in range(6)]
    try:
        await wait_until(lambda: gw.rt.scheduler.nodes["c"].slowed, timeout=60)
        for n in ("a", "b", "c"):
            cfg["nodes"][n]["slow"] = False  # `slow: off`
        gw.write_config(cfg)
        async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
            assert r.status == 200, await r.text()
        # lifted by the reload itself, whole (not a tick later): the verdict too, which is what
        # cluster mode publishes (tests/cluster/test_cluster_slow.py)
        c = gw.rt.scheduler.nodes["c"]
        assert (c.slowed, c.slow_state, c.slow_note) == (False, "ok", "")
        st = (await state(http, gw.url))["nodes"]["c"]
        assert st["speed"] is None and st["slots"] == 2
        before = len(seen)
        await wait_until(lambda: len(seen) >= before + 30, timeout=30)
        assert not gw.rt.scheduler.nodes["c"].slowed  # off stays off under load
        # back on, with its own settings: judged again from fresh samples
        for n in ("a", "b", "c"):
            cfg["nodes"][n]["slow"] = {**SLOW, "samples": 3}
        gw.write_config(cfg)
        async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
            assert r.status == 200, await r.text()
        assert gw.rt.scheduler.nodes["c"].cfg.slow.samples == 3
        await wait_until(lambda: gw.rt.scheduler.nodes["c"].slowed, timeout=60)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert {s for s, _ in seen} == {200}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_llm_answer_is_measured_per_generated_token(fakegpus, gateway, http, stream) -> None:
    fake = await fakegpus("openai", step_ms=20)  # one step per token
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", max_concurrency=1)
    gw = await gateway(cfg)
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "stream": stream}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        await r.read()
    await wait_until(lambda: gw.rt.speed.view("o") is not None, timeout=10)
    speed = (await state(http, gw.url))["nodes"]["o"]["speed"]
    assert speed["unit"] == "ms/token" and speed["state"] == "ok" and speed["peers_median"] is None
    assert 15 <= speed["ewma"] < 1000  # ~20 ms a token, plus what a busy box adds


async def test_far_slower_opens_the_breaker_then_a_trial_brings_it_back(fakegpus, gateway, http, tg, dc) -> None:
    a, b = await fakegpus(), await fakegpus()
    c = await fakegpus(slowdown=6)
    cfg = base_config({"a": a.url, "b": b.url, "c": c.url}, max_concurrency=2)
    cfg["routes"]["gen"].update(nodes=["a", "b", "c"], standby=[])
    for n in ("a", "b", "c"):
        cfg["nodes"][n].update(slow=SLOW, breaker={**BREAKER, "open_sec": 1, "max_open_sec": 4})
    cfg["notify"] = {"telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url},
                     "discord": {"webhook_url": dc.webhook_url}, "group_sec": 0.1, "min_interval_sec": 0}
    gw = await gateway(cfg)
    stop, seen = asyncio.Event(), []
    workers = [asyncio.create_task(load(http, gw.url, stop, seen)) for _ in range(6)]
    try:
        await wait_until(lambda: any("breaker OPEN for being slow" in m["text"] for m in tg.messages), timeout=60)
        assert any("c slow:" in m["text"] and "breaker is open" in m["text"] for m in tg.messages)
        c.slowdown = 1.0  # the neighbour left: back to speed
        await wait_until(lambda: any("c back to speed" in m["text"] for m in tg.messages), timeout=60)
        ns = gw.rt.scheduler.nodes["c"]
        assert not ns.slowed and ns.breaker == "closed"
        assert (await state(http, gw.url))["nodes"]["c"]["speed"]["state"] == "ok"
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert {s for s, _ in seen} == {200}
