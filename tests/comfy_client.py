"""A ComfyUI client for the gateway's comfyui routes: graphs, sse/async jobs, and the in-flight count."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from conftest import auth

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SSE = {**auth(), "X-KiloLine-Mode": "sse"}
ASYNC = {**auth(), "X-KiloLine-Mode": "async"}


def graph(steps: int = 10, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    nodes: dict[str, Any] = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": ["5", 0], "seed": 1, "steps": steps}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }
    nodes.update(extra or {})
    return nodes


async def read_sse(resp: aiohttp.ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) pairs from a raw text/event-stream, until the server closes it."""
    events: list[tuple[str, dict[str, Any]]] = []
    name, data = "message", ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                events.append((name, orjson.loads(data)))
            name, data = "message", ""
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
    return events


async def sse_job(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  headers: dict[str, str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    async with http.post(url, json=body, headers={**SSE, **(headers or {})}) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/event-stream"
        return await asyncio.wait_for(read_sse(r), 20)


async def async_job(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with http.post(url, json=body, headers=ASYNC) as r:
        assert r.status == 202, await r.text()
        return str((await r.json())["job_id"])


async def job_status(http: aiohttp.ClientSession, gw_url: str, job_id: str) -> dict[str, Any]:
    async with http.get(f"{gw_url}/v1/jobs/{job_id}", headers=auth()) as r:
        assert r.status == 200
        return dict(await r.json())


def inflight(gw: Any) -> int:
    return sum(gw.rt.scheduler.node_inflight.values())


def of(events: list[tuple[str, dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return [d for n, d in events if n == name]
