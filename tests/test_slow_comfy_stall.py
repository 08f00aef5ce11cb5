"""A ComfyUI node that stops moving while our prompt runs (no frame for ``slow.stall_sec``):
the prompt is interrupted there, the node's breaker opens (speed state "stalled"), and the job,
whose client has seen no byte of the answer, is re-queued to another node and completes."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from comfy_client import async_job, graph, inflight, of, sse_job
from conftest import ADMIN, base_config, wait_until

BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}


def data_of(frame: bytes) -> Any:
    """The JSON of a rendered SSE frame's data lines."""
    lines = frame.decode().splitlines()
    return orjson.loads("".join(line[5:].strip() for line in lines if line.startswith("data:")))


async def two_nodes(fakegpus: Any, gateway: Any) -> tuple[Any, Any, Any]:
    # a step of 20 ms × 10,000: the sampler starts, then nothing comes for minutes
    stuck = await fakegpus("comfyui", step_ms=20, slowdown=10_000)
    fine = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"s": stuck.url, "f": fine.url}, kind="comfyui", max_concurrency=1)
    for n in ("s", "f"):
        cfg["nodes"][n].update(slow={"stall_sec": 0.5}, breaker=BREAKER)
    return stuck, fine, await gateway(cfg)  # s is the primary, f its standby


@pytest.mark.parametrize("mode", ["sse", "async"])
async def test_a_prompt_that_stalls_is_interrupted_and_requeued(fakegpus: Any, gateway: Any,
                                                                 http: aiohttp.ClientSession, mode: str) -> None:
    stuck, fine, gw = await two_nodes(fakegpus, gateway)
    if mode == "sse":
        events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(3)})
    else:
        job_id = await async_job(http, gw.url + "/gen/prompt", {"prompt": graph(3)})
        await wait_until(lambda: gw.jobs.jobs[job_id].status in ("completed", "failed"), timeout=20)
        events = [(name, data_of(frame)) for _, name, frame in gw.jobs.jobs[job_id].events]
    rerouted = of(events, "rerouted")
    assert rerouted and rerouted[0]["from_node"] == "s" and rerouted[0]["to_node"] == "f", events
    assert "stalled" in rerouted[0]["reason"]
    assert of(events, "output_ready")[0]["http_status"] == 200
    assert fine.stats["served"] == 1
    # Interrupted on the stalled node, its slot freed, its breaker open.
    await wait_until(lambda: stuck.stats["interrupts"] == 1 and stuck.stats["running"] == 0, timeout=10)
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        st = (await r.json())["nodes"]["s"]
    assert st["breaker"] == "open" and "stalled" in (st["last_error"] or "")
    assert st["speed"]["state"] == "stalled"


async def test_a_prompt_that_keeps_moving_is_no_stall(fakegpus: Any, gateway: Any,
                                                       http: aiohttp.ClientSession) -> None:
    # 25 steps of 100 ms: the prompt runs well past stall_sec, but a frame comes every step
    # (stall_sec is 10 steps, room for a loaded box).
    fake = await fakegpus("comfyui", step_ms=100)
    cfg = base_config({"c": fake.url}, kind="comfyui", max_concurrency=1)
    cfg["nodes"]["c"].update(slow={"stall_sec": 1.0}, breaker=BREAKER)
    gw = await gateway(cfg)
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(25)})
    assert not of(events, "rerouted") and of(events, "output_ready")[0]["http_status"] == 200
    assert gw.rt.scheduler.nodes["c"].breaker == "closed" and fake.stats["interrupts"] == 0
