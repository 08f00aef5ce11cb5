"""Operator alerts end to end (SPEC §8): a real gateway raising node and route events to a fake
Telegram and a fake Discord, including when those are down or rate limiting."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until
from fakes import FakeDiscord, FakeTelegram

HEALTH = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 2}
BREAKER = {"consecutive_failures": 3, "open_sec": 0.5, "max_open_sec": 4, "slow_start_sec": 1}
JOB = {"steps": 5, "step_ms": 20}


# --- helpers -------------------------------------------------------------------------------------


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def gen(http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> tuple[int, str | None]:
    async with http.post(url + "/gen/generate", json=body or {}, headers=auth()) as r:
        await r.read()
        return r.status, r.headers.get("X-KiloLine-Node")


def notify_cfg(tg: FakeTelegram, dc: FakeDiscord, **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url},
        "discord": {"webhook_url": dc.webhook_url},
        "group_sec": 0.3,
        "min_interval_sec": 60,
    }
    cfg.update(kw)
    return cfg


def texts(fake: FakeTelegram | FakeDiscord) -> list[str]:
    key = "text" if isinstance(fake, FakeTelegram) else "content"
    return [m[key] for m in fake.messages]


def lines(fake: FakeTelegram | FakeDiscord) -> list[str]:
    return [line for t in texts(fake) for line in t.split("\n")]


async def wait_text(fake: FakeTelegram | FakeDiscord, needle: str, timeout: float = 10) -> float:
    """Wait until a message containing ``needle`` arrived; returns the monotonic time it was seen."""
    await wait_until(lambda: any(needle in t for t in texts(fake)), timeout=timeout, step=0.01)
    return time.monotonic()


async def burst(http: aiohttp.ClientSession, url: str, n: int) -> tuple[float, list[tuple[int, str | None]]]:
    t0 = time.monotonic()
    res = await asyncio.gather(*[gen(http, url, JOB) for _ in range(n)])
    return time.monotonic() - t0, res


# --- a sick notifier never slows the request path ---------------------------------------------------


@pytest.mark.parametrize("trouble", ["down", "429"])
async def test_notifier_trouble_does_not_slow_requests_and_the_alert_arrives_later(
    fakegpus, gateway, http, tg, dc, trouble
):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url}, max_concurrency=2)
    cfg["nodes"]["a"].update(label="Spot A", health=HEALTH, breaker=BREAKER)
    cfg["notify"] = notify_cfg(tg, dc)
    gw = await gateway(cfg)

    baseline, res = await burst(http, gw.url, 12)
    assert [s for s, _ in res] == [200] * 12

    if trouble == "down":
        tg.down = True
        dc.down = True
    else:
        tg.rate_limit_next, tg.retry_after = 1, 1
        dc.rate_limit_next, dc.retry_after = 1, 1.0

    # The same burst again, while the primary dies in the middle of it (alerts are raised
    # while requests are in flight and being re-queued).
    t0 = time.monotonic()
    tasks = [asyncio.create_task(gen(http, gw.url, JOB)) for _ in range(12)]
    await wait_until(lambda: a.stats["served"] >= 12 + 2, timeout=10, step=0.005)
    await a.kill()
    t_kill = time.monotonic()
    res = await asyncio.gather(*tasks)
    troubled = time.monotonic() - t0
    assert [s for s, _ in res] == [200] * 12
    # Loose bound: same order of magnitude as without notifier problems (a few re-queues included).
    assert troubled < 3 * baseline + 2.0, (baseline, troubled)

    # Unrelated requests stay fast while the channels are still failing.
    t1 = time.monotonic()
    assert await gen(http, gw.url, {"steps": 1, "step_ms": 1}) == (200, "b")
    assert time.monotonic() - t1 < 2.0

    await wait_until(lambda: tg.requests >= 1 and dc.requests >= 1, timeout=10)
    if trouble == "down":
        await asyncio.sleep(0.5)
        assert tg.messages == [] and dc.messages == []
        tg.down = False
        dc.down = False
    seen_tg = await wait_text(tg, "failing over", timeout=20)
    seen_dc = await wait_text(dc, "failing over", timeout=20)
    # Delivered after the wait the service asked for (or after the backoff), not dropped.
    assert seen_tg - t_kill >= 1.0 and seen_dc - t_kill >= 1.0
    assert tg.requests >= 2 and dc.requests >= 2
    for fake in (tg, dc):
        over = [t for t in texts(fake) if "failing over" in t]
        assert len(over) == 1, texts(fake)
        assert "a (Spot A)" in over[0]


async def test_notifier_down_for_good_is_not_fatal(fakegpus, gateway, http, tg, dc):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"].update(health=HEALTH, breaker=BREAKER)
    cfg["notify"] = notify_cfg(tg, dc)
    gw = await gateway(cfg)
    tg.down = True
    await tg.stop()  # connection refused from now on
    dc.down_mode = "503"
    dc.down = True
    await a.kill()

    async def failover() -> bool:
        return (await admin_state(http, gw.url))["routes"]["gen"]["mode"] == "failover"

    await wait_until(failover, timeout=10)
    await wait_until(lambda: dc.requests >= 1, timeout=10)
    for _ in range(5):
        assert await gen(http, gw.url) == (200, "b")
    async with http.get(gw.url + "/healthz") as r:
        assert r.status == 200


# --- grouping, folding, filtering on real events --------------------------------------------------------


async def test_route_down_and_up_alerts_when_the_only_node_dies_and_returns(fakegpus, gateway, http, tg, dc):
    a = await fakegpus()
    cfg = base_config({"a": a.url}, queue_timeout_sec=20)
    cfg["nodes"]["a"].update(label="Lonely GPU", health=HEALTH, breaker=BREAKER)
    cfg["notify"] = notify_cfg(tg, dc)
    gw = await gateway(cfg)
    await a.kill()
    await wait_text(tg, "no node can take work")
    await wait_text(dc, "no node can take work")
    down_msg = next(t for t in texts(tg) if "no node can take work" in t)
    assert "a (Lonely GPU) DOWN" in down_msg  # grouped with the node_down that caused it
    task = asyncio.create_task(gen(http, gw.url))
    await asyncio.sleep(0.3)
    await a.revive()
    assert await task == (200, "a")
    await wait_text(tg, "queue resumed")
    await wait_text(dc, "queue resumed")
    up_msg = next(t for t in texts(tg) if "queue resumed" in t)
    assert "a (Lonely GPU) UP" in up_msg


async def test_flapping_node_is_folded_by_min_interval(fakegpus, gateway, http, tg, dc):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"].update(health=HEALTH, breaker=BREAKER)
    cfg["notify"] = notify_cfg(tg, dc, group_sec=0.1, min_interval_sec=60)
    gw = await gateway(cfg)

    async def health_is(v: str) -> bool:
        return (await admin_state(http, gw.url))["nodes"]["a"]["health"] == v

    for _ in range(3):
        a.set_control(health_status=503)
        await wait_until(lambda: health_is("down"), timeout=10)
        a.set_control(health_status=200)
        await wait_until(lambda: health_is("up"), timeout=10)
    await asyncio.sleep(0.5)
    for fake in (tg, dc):
        got = lines(fake)
        assert len([x for x in got if " DOWN" in x and x.startswith("✗ a")]) == 1, got
        assert len([x for x in got if " UP" in x and x.startswith("✓ a")]) == 1, got
        assert len([x for x in got if "failing over" in x]) == 1, got


async def test_event_filter_sends_only_the_chosen_events(fakegpus, gateway, http, tg, dc):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"].update(health=HEALTH, breaker=BREAKER)
    cfg["notify"] = notify_cfg(tg, dc, events=["failover"], group_sec=0.1)
    gw = await gateway(cfg)
    await a.kill()
    await wait_text(tg, "failing over")
    await wait_text(dc, "failing over")
    assert (await admin_state(http, gw.url))["nodes"]["a"]["health"] == "down"
    await asyncio.sleep(0.4)
    assert all("failing over" in x for x in lines(tg)), lines(tg)
    assert all("failing over" in x for x in lines(dc)), lines(dc)


# --- failback is announced when the primary really is back ------------------------------------------


async def test_half_open_breaker_of_a_dead_primary_is_not_announced_as_failback(fakegpus, gateway, http, tg, dc):
    """No health checks: the breaker alone tracks the dead primary. Its half-open phase is a probe,
    not a recovery: the operator must not read "back on primary" while the node is still dead, and
    must hear it once the node really serves again."""
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url, "b": b.url}, retry_on_failover=1)
    cfg["nodes"]["a"].update(label="Spot A", breaker={**BREAKER, "open_sec": 0.3})
    cfg["notify"] = notify_cfg(tg, dc, group_sec=0.1)
    gw = await gateway(cfg)
    await a.kill()
    for _ in range(3):
        assert await gen(http, gw.url) == (200, "b")
    await wait_text(tg, "failing over")
    # Dead and idle past open_sec: the breaker goes half-open, nothing has proven the node well.
    await asyncio.sleep(1.0)
    assert not any("back on primary" in t for t in texts(tg)), texts(tg)
    await a.revive()
    # The next request is the trial; it succeeds and closes the breaker: that is the failback.
    assert await gen(http, gw.url) == (200, "a")
    assert (await admin_state(http, gw.url))["nodes"]["a"]["breaker"] == "closed"
    await wait_text(tg, "back on primary", timeout=5)
    await wait_text(dc, "back on primary", timeout=5)
