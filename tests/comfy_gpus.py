"""A ComfyUI graph for many cards, which node ran a prompt, posting it, and hearing its socket."""

from __future__ import annotations

import struct
from typing import Any

import aiohttp
import orjson
from conftest import auth

from kilolined.adapters.comfy_control import comfy_state


def graph(steps: int, seed: int) -> dict[str, Any]:
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": ["5", 0], "seed": seed, "steps": steps}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }


def node_of(gw: Any, pid: str) -> str:
    p = comfy_state(gw.rt).owners("gen").get(pid)
    assert p is not None
    return p.node


async def post(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any], who: str = "alice") -> dict[str, Any]:
    async with http.post(gw.url + "/gen/prompt", json=body, headers=auth(who)) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def hear(ws: aiohttp.ClientWebSocketResponse, until_done: set[str]) -> list[tuple[str, Any]]:
    """(type, data) of every frame (("binary", bytes) for previews) until each prompt's last
    ``executing`` (node null) has come."""
    frames: list[tuple[str, Any]] = []
    left = set(until_done)
    while left:
        msg = await ws.receive(timeout=15)
        if msg.type == aiohttp.WSMsgType.BINARY:
            frames.append(("binary", msg.data))
            continue
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        doc = orjson.loads(msg.data)
        frames.append((doc["type"], doc["data"]))
        if doc["type"] == "executing" and doc["data"].get("node") is None:
            left.discard(doc["data"].get("prompt_id"))
    return frames


def kinds_of(frames: list[tuple[str, Any]], pid: str) -> list[str]:
    return [k for k, d in frames if isinstance(d, dict) and d.get("prompt_id") == pid]


def preview_ids(frames: list[tuple[str, Any]]) -> list[str]:
    out = []
    for kind, data in frames:
        if kind == "binary" and struct.unpack(">I", data[:4])[0] == 4:
            size = struct.unpack(">I", data[4:8])[0]
            out.append(orjson.loads(data[8:8 + size])["prompt_id"])
    return out


async def get(http: aiohttp.ClientSession, gw: Any, path: str, headers: dict[str, str]) -> Any:
    async with http.get(gw.url + "/gen" + path, headers=headers) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.json()
