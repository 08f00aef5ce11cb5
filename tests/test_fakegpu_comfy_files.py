"""The fake ComfyUI's files behave as ComfyUI 0.19.3's: uploads, their renaming, /view, LoadImage's
validation error, SaveImage's numbering, and separate files per node.

``probe`` drives any ComfyUI and returns what it saw; EXPECTED is what ComfyUI 0.19.3 answers, read
from its source (server.py ``image_upload`` / ``view_image``, nodes.py ``LoadImage.VALIDATE_INPUTS``,
execution.py ``validate_inputs`` / ``validate_prompt``, folder_paths.py ``get_save_image_path``) and
checked against a running one: ``python tests/test_fakegpu_comfy_files.py http://127.0.0.1:8188``
prints the differences (none).
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import aiohttp

from kilolined.fakegpu.comfy_graph import make_png


def expected(stem: str) -> dict[str, Any]:
    name = f"{stem}.png"
    return {
        "upload": {"name": name, "subfolder": "", "type": "input"},
        "same bytes again": {"name": name, "subfolder": "", "type": "input"},
        "other bytes": {"name": f"{stem} (1).png", "subfolder": "", "type": "input"},
        "overwrite": {"name": name, "subfolder": "", "type": "input"},
        "subfolder": {"name": name, "subfolder": "sub", "type": "input"},
        "no image field": 400,
        "dots in a name": {"name": f"{stem}..png", "subfolder": "", "type": "input"},
        "a name that leaves the folder": 400,
        "view of a name with dots": 400,
        "prompt on a name with dots": {"3": {"images": [{"filename": f"{stem}d_00001_.png", "subfolder": "",
                                                         "type": "output"}]}},
        "view input": (200, "other bytes", f'filename="{name}"'),
        "view dotdot": 400,
        "view escaping subfolder": 403,
        "view missing": 404,
        "missing input": (400, {
            "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                      "details": "", "extra_info": {}},
            "node_errors": {"1": {"errors": [{
                "type": "custom_validation_failed", "message": "Custom validation failed for node",
                "details": f"image - Invalid image file: missing-{name}", "extra_info": {"input_name": "image"}}],
                "dependent_outputs": ["3"], "class_type": "LoadImage"}}}),
        "outputs": {"3": {"images": [{"filename": f"{stem}_00001_.png", "subfolder": "", "type": "output"}]}},
        "second outputs": {"3": {"images": [{"filename": f"{stem}_00002_.png", "subfolder": "", "type": "output"}]}},
        "view output": (200, "png"),
    }


def img2img(image: str, prefix: str) -> dict[str, Any]:
    return {"1": {"class_type": "LoadImage", "inputs": {"image": image}},
            "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
            "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}}}


async def _upload(http: aiohttp.ClientSession, url: str, name: str | None, data: bytes, **fields: str) -> Any:
    form = aiohttp.FormData()
    if name is not None:
        form.add_field("image", data, filename=name, content_type="image/png")
    for k, v in fields.items():
        form.add_field(k, v)
    async with http.post(url + "/upload/image", data=form) as r:
        return await r.json() if r.status == 200 else r.status


async def _run(http: aiohttp.ClientSession, url: str, graph: dict[str, Any]) -> Any:
    async with http.post(url + "/prompt", json={"prompt": graph}) as r:
        if r.status != 200:
            return r.status, await r.json()
        pid = (await r.json())["prompt_id"]
    for _ in range(600):
        async with http.get(f"{url}/history/{pid}") as r:
            entry = (await r.json()).get(pid)
        if entry is not None:
            return entry["outputs"]
        await asyncio.sleep(0.05)
    raise AssertionError("the prompt did not finish")


async def probe(url: str, stem: str) -> dict[str, Any]:
    name = f"{stem}.png"
    png, other = make_png(stem + "a"), make_png(stem + "b")
    seen: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        seen["upload"] = await _upload(http, url, name, png)
        seen["same bytes again"] = await _upload(http, url, name, png)
        seen["other bytes"] = await _upload(http, url, name, other)
        seen["overwrite"] = await _upload(http, url, name, other, overwrite="true")
        seen["subfolder"] = await _upload(http, url, name, png, subfolder="sub")
        seen["no image field"] = await _upload(http, url, None, b"", subfolder="sub")
        # ComfyUI's upload refuses only a name whose path leaves the folder; its /view, any with ``..``
        seen["dots in a name"] = await _upload(http, url, f"{stem}..png", png)
        seen["a name that leaves the folder"] = await _upload(http, url, "..", png)
        async with http.get(url + "/view", params={"filename": f"{stem}..png", "type": "input"}) as r:
            seen["view of a name with dots"] = r.status
        seen["prompt on a name with dots"] = await _run(http, url, img2img(f"{stem}..png", stem + "d"))
        async with http.get(url + "/view", params={"filename": name, "type": "input"}) as r:
            body = await r.read()
            seen["view input"] = (r.status, "other bytes" if body == other else body[:20],
                                  r.headers.get("Content-Disposition"))
        async with http.get(url + "/view", params={"filename": "../x.png"}) as r:
            seen["view dotdot"] = r.status
        async with http.get(url + "/view", params={"filename": name, "subfolder": "../..", "type": "input"}) as r:
            seen["view escaping subfolder"] = r.status
        async with http.get(url + "/view", params={"filename": f"none-{name}", "type": "input"}) as r:
            seen["view missing"] = r.status
        seen["missing input"] = await _run(http, url, img2img(f"missing-{name}", stem))
        seen["outputs"] = await _run(http, url, img2img(f"sub/{name}", stem))
        seen["second outputs"] = await _run(http, url, img2img(name, stem))
        out = seen["outputs"]["3"]["images"][0] if isinstance(seen["outputs"], dict) else {}
        async with http.get(url + "/view", params={k: out.get(k, "") for k in ("filename", "subfolder", "type")}) as r:
            seen["view output"] = (r.status, "png" if (await r.read()).startswith(b"\x89PNG") else "not a png")
    return seen


async def test_the_fake_answers_as_comfyui_does(fakegpus: Any) -> None:
    fake = await fakegpus("comfyui", steps=1, step_ms=1)
    stem = "p" + uuid.uuid4().hex[:8]
    assert await probe(fake.url, stem) == expected(stem)


async def test_each_fake_node_has_files_of_its_own(fakegpus: Any) -> None:
    a = await fakegpus("comfyui", steps=1, step_ms=1)
    b = await fakegpus("comfyui", steps=1, step_ms=1)
    async with aiohttp.ClientSession() as http:
        assert (await _upload(http, a.url, "cat.png", make_png("cat")))["name"] == "cat.png"
        ok = await _run(http, a.url, img2img("cat.png", "x"))
        missing = await _run(http, b.url, img2img("cat.png", "x"))
        async with http.get(b.url + "/view", params={"filename": ok["3"]["images"][0]["filename"]}) as r:
            assert r.status == 404
    assert ok["3"]["images"][0]["filename"] == "x_00001_.png"
    assert missing[0] == 400 and missing[1]["node_errors"]["1"]["class_type"] == "LoadImage"


if __name__ == "__main__":
    stem = "p" + uuid.uuid4().hex[:8]
    got, want = asyncio.run(probe(sys.argv[1].rstrip("/"), stem)), expected(stem)
    for key in want:
        print(("ok  " if got.get(key) == want[key] else "DIFF") + f" {key}: {got.get(key)!r}"
              + ("" if got.get(key) == want[key] else f"\n     want {want[key]!r}"))
