"""A ComfyUI node's speed is measured per sampler step (its ``progress`` frames), so prompts of
different step counts compare; a prompt that ran no step (all cached) is measured as before."""

from __future__ import annotations

from typing import Any

import aiohttp
from comfy_client import graph, inflight, of, sse_job
from conftest import ADMIN, base_config, wait_until

from kilolined.adapters.comfy_progress import Progress


def test_steps_ran_counts_what_the_node_reported_in_this_attempt() -> None:
    p = Progress(graph(10))
    p.cached(["4", "5"])  # cached nodes ran nothing
    assert p.steps_ran() == 0
    for v in range(1, 5):
        p.step("3", v, 10)
    p.step("3", 3, 10)  # a repeated or late frame never counts twice
    assert p.steps_ran() == 4
    p.attempt()  # re-queued to another node: its steps start from zero
    assert p.steps_ran() == 0
    p.step("3", 10, 10)
    p.step("12", 2, 2)  # an upscaler's own steps add up
    assert p.steps_ran() == 12


async def test_a_comfyui_job_is_measured_in_ms_per_step(fakegpus: Any, gateway: Any,
                                                        http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(6)})
    assert of(events, "output_ready")[0]["http_status"] == 200
    await wait_until(lambda: inflight(gw) == 0)

    async def speed() -> Any:
        async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
            return (await r.json())["nodes"]["c"]["speed"]

    await wait_until(lambda: speed(), timeout=10)
    sp = await speed()
    # Each of the 6 steps sleeps step_ms on the fake card: at least 20 ms a step.
    assert sp["unit"] == "ms/step" and sp["ewma"] >= 20, sp
