"""A fake Vast.ai for the autoscale tests: the `vast` fixture and a scaling config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import base_config

from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_vastai import VastWire

API_KEY = "vast-SECRET-key-0123456789abcdef"
HEALTH = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 1}
SPOT = {"gpu_name": "RTX 4090", "num_gpus": 1, "max_dph": 0.5, "min_reliability": 0.97, "interruptible": True}


@pytest.fixture
async def vast() -> AsyncIterator[FakeProvider]:
    # Longer than the 1 s heartbeat, so that a waiting request gets a queue_status.
    fp = FakeProvider(VastWire(), api_key=API_KEY, boot_sec=1.5, resume_sec=1.2,
                      card_options={"steps": 2, "step_ms": 20})
    await fp.start()
    yield fp
    await fp.stop()


def scaling_config(static_url: str, fp: FakeProvider, **pool_over: Any) -> dict[str, Any]:
    cfg = base_config({"static": static_url})
    cfg["routes"]["pool"] = {"path": "/pool", "nodes": [], "max_concurrency": 2, "queue_timeout_sec": 60,
                             "request_timeout_sec": 30}
    pool = {"provider": "vast", "min": 0, "max": 2, "routes": ["pool"], "boot_timeout_sec": 20,
            "backoff_base_sec": 0.2, "scale_up_wait_sec": 1, "idle_stop_sec": 1, "stopped_destroy_sec": 0,
            "offers": [SPOT],
            "template": {"image": "fake/generic", "disk_gb": 10, "env": {"FAKEGPU_KIND": "generic"}, "port": 8080},
            "node": {"health": HEALTH, "max_concurrency": 2}}
    pool.update(pool_over)
    cfg["fleet"] = {"providers": {"vast": {"kind": "vastai", "api_key": API_KEY, "api_base": fp.url}},
                    "pools": {"p": pool}, "max_spend_per_hour": 2.0}
    return cfg
