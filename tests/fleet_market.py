"""A fake GPU market for the fleet tests: the `market` fixture, a pool config and its waits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from conftest import base_config

from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_runpod import RunPodWire
from kilolined.fakegpu.provider_vastai import VastWire

API_KEY = "vast-SECRET-key-0123456789abcdef"
HEALTH = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 1}
WAIT = 30  # generous: a loaded 2-core box


@pytest.fixture
async def market() -> AsyncIterator[Callable[..., Awaitable[FakeProvider]]]:
    made: list[FakeProvider] = []

    async def make(boot_sec: float = 0.3, runpod: bool = False) -> FakeProvider:
        fp = FakeProvider(RunPodWire() if runpod else VastWire(), api_key=API_KEY, boot_sec=boot_sec,
                          card_options={"steps": 4, "step_ms": 25})
        await fp.start()
        made.append(fp)
        return fp

    yield make
    for fp in made:
        await fp.stop()


def pool(size: int = 2, route: str = "pool", max_dph: float = 0.5) -> dict[str, Any]:
    return {"provider": "vast", "size": size, "routes": [route], "boot_timeout_sec": 20, "backoff_base_sec": 0.2,
            "offer": {"gpu_name": "RTX 4090", "num_gpus": 1, "max_dph": max_dph, "min_reliability": 0.97,
                      "interruptible": True},
            "template": {"image": "fake/generic", "disk_gb": 10, "env": {"FAKEGPU_KIND": "generic"}, "port": 8080},
            "node": {"health": HEALTH, "max_concurrency": 2, "label": "Vast {id}"}}


def fleet_config(static_url: str, fp: FakeProvider, pools: dict[str, Any], cap: float = 2.0) -> dict[str, Any]:
    cfg = base_config({"static": static_url})
    cfg["nodes"]["static"]["health"] = HEALTH
    for name in {r for p in pools.values() for r in p["routes"]}:
        cfg["routes"][name] = {"path": f"/{name}", "nodes": [], "max_concurrency": 2, "queue_timeout_sec": 60,
                               "request_timeout_sec": 30, "retry_on_failover": 3}
    cfg["fleet"] = {"providers": {"vast": {"kind": "vastai", "api_key": API_KEY, "api_base": fp.url}},
                    "pools": pools, "max_spend_per_hour": cap}
    return cfg


def live(fp: FakeProvider, label: str | None = None) -> list[Any]:
    return [i for i in fp.live() if label is None or i.label == label]


def serving(gw: Any, pool_name: str = "p") -> list[str]:
    """Pool nodes in the scheduler that are up (joined their routes)."""
    return [n for n, p in gw.rt.pool_nodes.items() if p.pool == pool_name and gw.rt.scheduler.nodes[n].healthy]
