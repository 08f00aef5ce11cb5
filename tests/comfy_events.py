"""A ComfyUI graph and a reader of the fake GPU's websocket events."""

from __future__ import annotations

import contextlib
from typing import Any

import aiohttp


def graph(steps: int | None = 10, *, seed: int = 1, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    sampler: dict[str, Any] = {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                               "latent_image": ["5", 0], "seed": seed}
    if steps is not None:
        sampler["steps"] = steps
    nodes = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": sampler},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }
    nodes.update(extra or {})
    return nodes


async def drain(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    """What the socket received until it went quiet."""
    seen = []
    with contextlib.suppress(TimeoutError):
        while True:
            seen.append(await ws.receive_json(timeout=0.2))
    return seen


def kinds(seen: list[dict[str, Any]], *skip: str) -> list[str]:
    return [m["type"] for m in seen if m["type"] not in skip]
