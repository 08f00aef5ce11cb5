"""Cost and capacity end to end: the real gateway in front of a fake 24 GB card whose jobs take the
VRAM their requests imply (docs/CONFIG.md#cost-and-capacity), over loopback sockets."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config

from kilolined.fakegpu import FakeGPU

LARGE, SMALL = 12.0, 3.0  # GB that a job of each size takes on the card


def cost_config(url: str, *, cost: bool, slots: int = 8, capacity: float | None = 22) -> dict[str, Any]:
    cfg = base_config({"gpu": url}, max_concurrency=slots, max_queue_depth=500, queue_timeout_sec=60,
                      retry_on_failover=0)
    if capacity is not None:
        cfg["nodes"]["gpu"]["capacity"] = capacity
    if cost:
        cfg["routes"]["gen"]["cost"] = {"base": 0, "per_unit": 1, "unit": "json:/vram_gb"}
    return cfg


async def burst(http: aiohttp.ClientSession, url: str, sizes: list[float]) -> list[int]:
    async def one(gb: float) -> int:
        async with http.post(url + "/gen/generate", json={"vram_gb": gb}, headers=auth()) as r:
            await r.read()
            return r.status

    return list(await asyncio.gather(*(one(gb) for gb in sizes)))


MIXED = [LARGE if i % 4 == 0 else SMALL for i in range(24)]


async def test_cost_aware_admission_keeps_a_mixed_burst_inside_the_card(fakegpus: Any, gateway: Any,
                                                                         http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("generic", capacity_mode="request", vram_gb=24, steps=4, step_ms=25)
    gw = await gateway(cost_config(gpu.url, cost=True))
    statuses = await burst(http, gw.url, MIXED)
    assert statuses == [200] * len(MIXED)
    assert gpu.stats["oom_count"] == 0 and gpu.stats["crashes"] == 0
    assert gpu.stats["peak_vram_gb"] <= 22
    assert gpu.stats["max_concurrent"] > 2  # small jobs ran side by side: the card was not idle
    assert not gw.rt.scheduler.capacity_used and gw.rt.scheduler.routes["gen"].capacity_used == 0


async def test_the_same_burst_through_fixed_slots_runs_the_card_out_of_memory(fakegpus: Any, gateway: Any,
                                                                                http: aiohttp.ClientSession) -> None:
    """The baseline the cost rule is measured against: 8 equal slots, no cost."""
    gpu: FakeGPU = await fakegpus("generic", capacity_mode="request", vram_gb=24, steps=4, step_ms=25,
                                  crash_sec=0.2)
    gw = await gateway(cost_config(gpu.url, cost=False))
    statuses = await burst(http, gw.url, MIXED)
    assert gpu.stats["oom_count"] > 0 and any(s != 200 for s in statuses)


async def error_of(r: aiohttp.ClientResponse) -> dict[str, Any]:
    body = await r.json()
    assert set(body) == {"error"} and body["error"]["request_id"] == r.headers["X-Request-Id"]
    return dict(body["error"])


async def test_a_request_no_node_can_hold_is_422_at_once(fakegpus: Any, gateway: Any,
                                                         http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("generic", capacity_mode="request")
    gw = await gateway(cost_config(gpu.url, cost=True))
    async with http.post(gw.url + "/gen/generate", json={"vram_gb": 23}, headers=auth()) as r:
        assert r.status == 422
        err = await error_of(r)
    assert err["type"] == "exceeds_capacity" and "23" in err["message"] and "22" in err["message"]
    assert gpu.requests == []


@pytest.mark.parametrize("bad", ["12", None, True, {"gb": 1}, -1])
async def test_an_unreadable_unit_is_400(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, bad: Any) -> None:
    gpu: FakeGPU = await fakegpus("generic", capacity_mode="request")
    gw = await gateway(cost_config(gpu.url, cost=True))
    async with http.post(gw.url + "/gen/generate", json={"vram_gb": bad}, headers=auth()) as r:
        assert r.status == 400
        assert (await error_of(r))["type"] == "bad_request"
    async with http.post(gw.url + "/gen/generate", data=b"not json", headers=auth()) as r:
        assert r.status == 400
    assert gpu.requests == []


async def test_cost_is_visible_in_202_state_metrics_and_the_access_log(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    gpu: FakeGPU = await fakegpus("generic", capacity_mode="request", steps=40, step_ms=25)
    gw = await gateway(cost_config(gpu.url, cost=True))
    caplog.set_level(logging.INFO, logger="kilolined.access")
    async with http.post(gw.url + "/gen/generate", json={"vram_gb": 7.5},
                         headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        assert r.status == 202
        sub = await r.json()
    assert sub["cost"] == 7.5
    async with http.get(gw.url + f"/v1/jobs/{sub['job_id']}/events", headers=auth()) as r:
        first = await r.content.readuntil(b"\n\n")
        while b"event: queued" not in first:  # after the `retry:` preamble
            first = await r.content.readuntil(b"\n\n")
    queued = json.loads(first.split(b"data: ", 1)[1])
    assert queued["cost"] == 7.5
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = await r.json()
    assert state["nodes"]["gpu"]["capacity"] == 22 and state["nodes"]["gpu"]["capacity_used"] == 7.5
    assert state["routes"]["gen"]["capacity_used"] == 7.5
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    assert 'kiloline_capacity{node="gpu"} 22.0' in text
    assert 'kiloline_capacity_used{node="gpu"} 7.5' in text
    assert any(" cost=7.5" in rec.getMessage() for rec in caplog.records if rec.name == "kilolined.access")
