"""The simulated GPU's `capacity_mode="request"`: each job holds the VRAM its request implies
(comfyui: 4 + 1.5 × megapixels; openai: 0.00032 × tokens; generic: `vram_gb`), over real sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from fakegpu_util import MakeGPU, eventually


def comfy_prompt(w: int, h: int, batch: int) -> dict[str, Any]:
    return {"prompt": {
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": w, "height": h, "batch_size": batch}},
        "3": {"class_type": "KSampler", "inputs": {"latent_image": ["5", 0], "seed": 1, "steps": 20}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["3", 0]}},
    }, "client_id": "c1"}


async def test_comfy_job_holds_what_its_latents_imply(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", capacity_mode="request", parallel=4, step_ms=40)
    async with http.post(gpu.url + "/prompt", json=comfy_prompt(1024, 1024, 2)) as r:
        assert r.status == 200
    await eventually(lambda: gpu.stats["running"] == 1)
    assert gpu.stats["vram_used_gb"] == pytest.approx(4 + 1.5 * 1024 * 1024 * 2 / 1e6, abs=1e-3)


async def test_requests_that_overflow_the_card_crash_it(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("generic", capacity_mode="request", vram_gb=24, step_ms=50)

    async def one(gb: float) -> int:
        async with http.post(gpu.url + "/generate", json={"vram_gb": gb}) as r:
            await r.read()
            return r.status

    assert await asyncio.gather(one(10), one(10)) == [200, 200]
    assert gpu.stats["peak_vram_gb"] == 20 and gpu.stats["oom_count"] == 0
    results = await asyncio.gather(one(10), one(10), one(10), return_exceptions=True)
    assert gpu.stats["oom_count"] == 3 and gpu.stats["crashes"] == 1
    assert any(not isinstance(x, int) or x != 200 for x in results)


async def test_openai_job_holds_kv_for_prompt_and_generation(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", capacity_mode="request", steps=50, step_ms=30)
    body = {"model": "fake-llm", "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 996,
            "stream": True}
    async with http.post(gpu.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.content.readline()
        assert gpu.stats["vram_used_gb"] == pytest.approx(0.00032 * 1000, abs=1e-3)


async def test_fixed_mode_ignores_the_request(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("generic", job_vram_gb=10, step_ms=30)
    async with http.post(gpu.url + "/generate", json={"vram_gb": 1}) as r:
        assert r.status == 200
    assert gpu.stats["peak_vram_gb"] == 10 and gpu.stats["capacity_mode"] == "fixed"
