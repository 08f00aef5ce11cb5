"""A ComfyUI client for the file paths: upload, run a job, read its images back."""

from __future__ import annotations

from typing import Any

import aiohttp
from conftest import auth, base_config, wait_until

ASYNC = {"X-KiloLine-Mode": "async"}


def img2img(image: str, prefix: str = "ComfyUI") -> dict[str, Any]:
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": image}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }


def two_nodes(a: Any, b: Any, **over: Any) -> dict[str, Any]:
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1, **over)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    return cfg


async def upload(http: aiohttp.ClientSession, url: str, name: str, data: bytes, who: str = "alice",
                 **fields: str) -> dict[str, Any]:
    form = aiohttp.FormData()
    form.add_field("image", data, filename=name, content_type="image/png")
    for k, v in fields.items():
        form.add_field(k, v)
    async with http.post(url + "/gen/upload/image", data=form, headers=auth(who)) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def run_job(http: aiohttp.ClientSession, gw: Any, graph: dict[str, Any], who: str = "alice") -> dict[str, Any]:
    """An async job to its end; its result (the history entry, in the route's names)."""
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph}, headers={**auth(who), **ASYNC}) as r:
        assert r.status == 202, await r.text()
        job_id = (await r.json())["job_id"]
    await wait_until(lambda: gw.jobs.jobs[job_id].status in ("completed", "failed", "cancelled"), timeout=20)
    job = gw.jobs.jobs[job_id]
    assert job.status == "completed", job.events
    assert job.result is not None
    return dict(job.result.result)


def images(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [img for out in result["outputs"].values() for img in out.get("images", [])]


async def view(http: aiohttp.ClientSession, gw: Any, img: dict[str, Any], who: str = "alice") -> tuple[int, bytes]:
    q = {"filename": img["filename"], "subfolder": img["subfolder"], "type": img["type"]}
    async with http.get(gw.url + "/gen/view", params=q, headers=auth(who)) as r:
        return r.status, await r.read()
