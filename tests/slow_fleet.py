"""Fixtures for the slow-node tests: a datacenter of fake cards, a Telegram sink and a load generator."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from conftest import auth, base_config
from fakes import FakeDiscord, FakeTelegram

SLOW = {"samples": 4, "evaluations": 2, "min_gap_ms": 1}
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "max_open_sec": 120, "slow_start_sec": 0}
JOB = {"steps": 5, "step_ms": 20}  # long enough that the gateway's own overhead on a busy box stays small


@pytest.fixture
async def tg() -> Any:
    async with FakeTelegram() as f:
        yield f


@pytest.fixture
async def dc() -> Any:
    async with FakeDiscord() as f:
        yield f


async def load(http: aiohttp.ClientSession, url: str, stop: asyncio.Event, seen: list[tuple[int, str]]) -> None:
    while not stop.is_set():
        async with http.post(url + "/gen/generate", json=JOB, headers=auth()) as r:
            await r.read()
            seen.append((r.status, r.headers.get("X-KiloLine-Node", "")))


async def fleet(fakegpus: Any, gateway: Any, tg: FakeTelegram, dc: FakeDiscord, slow: Any = SLOW) -> tuple[Any, ...]:
    a, b = await fakegpus(), await fakegpus()
    c = await fakegpus(slowdown=2.5)
    cfg = base_config({"a": a.url, "b": b.url, "c": c.url}, max_concurrency=2)
    cfg["routes"]["gen"].update(nodes=["a", "b", "c"], standby=[])
    for n in ("a", "b", "c"):
        cfg["nodes"][n].update(breaker=BREAKER, slow=slow)
    cfg["nodes"]["c"]["label"] = "Spot C"
    cfg["notify"] = {"telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url},
                     "discord": {"webhook_url": dc.webhook_url}, "group_sec": 0.1, "min_interval_sec": 60}
    return a, b, c, cfg, await gateway(cfg)
