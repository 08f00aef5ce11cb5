"""The gateway against the ComfyUI fake where it now behaves as ComfyUI 0.19.3 (issue 13).

Each test here fails because of the ComfyUI adapter, not the fake; they are strict xfails naming
the issue-13 item, so they turn into failures (to un-mark) the moment the adapter is fixed.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest
from conftest import auth, base_config, wait_until


def graph(steps: int, seed: int) -> dict[str, Any]:
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["6", 0],
                                                   "latent_image": ["5", 0], "seed": seed, "steps": steps}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }


@pytest.mark.xfail(reason="issue 13 #1: a reused prompt_id ends the sync hold on the old history entry",
                   strict=True)
async def test_sync_prompts_reusing_a_finished_id_still_wait_for_the_slot(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    reused = str(uuid.uuid4())
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(2, 0), "prompt_id": reused},
                         headers=auth()) as r:
        assert r.status == 200
    await wait_until(lambda: fake.stats["served"] == 1)
    fake.reset()

    async def one(seed: int) -> int:
        body = {"prompt": graph(10, seed), "prompt_id": reused}
        async with http.post(gw.url + "/gen/prompt", json=body, headers=auth()) as r:
            return r.status

    assert await asyncio.gather(*(one(seed) for seed in range(1, 4))) == [200] * 3
    # With the slot held until each prompt ends, the card never runs two (3 x 10 GB would not fit).
    assert fake.stats["max_concurrent"] == 1 and fake.stats["oom_count"] == 0
