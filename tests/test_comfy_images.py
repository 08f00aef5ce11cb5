"""OpenAI's Images API over ComfyUI workflows (docs/API.md "Images over ComfyUI workflows"): the
official ``openai`` SDK's images.generate (b64_json and url, n=2) and images.edit against a
gateway whose comfyui route has templates, over fake ComfyUI nodes on loopback; a bad value is
400 naming the input, an unknown template 404 model_not_found, both in OpenAI's shape; an edit's
image reaches the node that runs it; a template's workflow is checked and read again on reload."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from comfy_workflows import INVERT, TXT2IMG, TXT2IMG_INPUTS
from conftest import KEYS, auth, base_config, wait_until
from reload_admin import admin_reload

from kilolined.adapters.comfy_store import files_state
from kilolined.core.config import ConfigError, load_config, parse_config
from kilolined.fakegpu.comfy_graph import make_png


def templated(cfg: dict[str, Any], tmp_path: Path, relative: bool = False) -> dict[str, Any]:
    """The route with two templates; their workflows relative to the config file, or (for the
    gateway fixture, which parses the config's text) absolute."""
    (tmp_path / "wf").mkdir(exist_ok=True)
    at = "" if relative else f"{tmp_path}/"
    (tmp_path / "wf" / "txt2img.json").write_text(json.dumps(TXT2IMG))
    (tmp_path / "wf" / "invert.json").write_text(json.dumps({"prompt": INVERT}))  # a saved POST /prompt body
    cfg["routes"]["gen"]["templates"] = {
        "sd15": {"workflow": f"{at}wf/txt2img.json", "inputs": TXT2IMG_INPUTS},
        "invert": {"workflow": f"{at}wf/invert.json", "inputs": {"image": "10.inputs.image"}},
    }
    return cfg


def graphs(node: Any) -> list[dict[str, Any]]:
    """The graphs the fake node ran, oldest first (its history's queue items)."""
    return [e["prompt"][2] for e in node.backend.history.values()]


def client(gw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/gen/v1", api_key=KEYS["alice"], max_retries=0)


async def test_sdk_generate_b64_and_url_with_n_2(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                 tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=2, step_ms=5)
    gw = await gateway(templated(base_config({"a": node.url}, kind="comfyui"), tmp_path))
    sdk = client(gw)
    got = await sdk.images.generate(model="sd15", prompt="a red fox", n=2, size="256x128",
                                    extra_body={"seed": 7}, response_format="b64_json")
    assert got.data is not None and len(got.data) == 2
    pngs = [base64.b64decode(d.b64_json or "") for d in got.data]
    assert all(p.startswith(b"\x89PNG") for p in pngs) and pngs[0] != pngs[1]
    # The node ran the filled workflow: the client's values in their inputs, typed.
    sent = graphs(node)[-1]
    assert sent["6"]["inputs"]["text"] == "a red fox"
    assert (sent["5"]["inputs"]["width"], sent["5"]["inputs"]["height"], sent["5"]["inputs"]["batch_size"]) == \
        (256, 128, 2)
    assert sent["3"]["inputs"]["seed"] == 7
    assert not any("kiloline_images" in str(k) for k in sent)

    by_url = await sdk.images.generate(model="sd15", prompt="a blue fox", n=2, response_format="url")
    assert by_url.data is not None and len(by_url.data) == 2
    for d in by_url.data:
        assert d.url is not None and d.url.startswith(gw.url + "/gen/view?")
        async with http.get(d.url, headers=auth()) as r:
            assert r.status == 200 and (await r.read()).startswith(b"\x89PNG")
        async with http.get(d.url, headers=auth("bob")) as r:
            assert r.status == 404  # another key's file
    # The URLs outlive the node: the outputs were copied to the route's file store.
    await wait_until(lambda: files_state(gw.rt).copies == 0)
    await node.kill()
    for d in by_url.data:
        async with http.get(d.url or "", headers=auth()) as r:
            assert r.status == 200 and (await r.read()).startswith(b"\x89PNG")
    await sdk.close()


async def test_sdk_edit_image_goes_to_the_node_that_runs_it(fakegpus: Any, gateway: Any, tmp_path: Path) -> None:
    a = await fakegpus("comfyui", steps=1, step_ms=5)
    b = await fakegpus("comfyui", steps=1, step_ms=5)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    gw = await gateway(templated(cfg, tmp_path))
    sdk = client(gw)
    pngs = [make_png(f"photo{i}") for i in range(2)]
    answers = [await sdk.images.edit(model="invert", image=("photo.png", p, "image/png"), prompt="invert it")
               for p in pngs]
    outs = [base64.b64decode(ans.data[0].b64_json or "") for ans in answers if ans.data]
    assert len(outs) == 2 and outs[0] != outs[1]  # each output depends on its own input
    # The node that ran an edit holds that edit's image in its input directory.
    inputs = {data for n in (a, b) for (kind, _, _), data in n.backend.images.items() if kind == "input"}
    assert set(pngs) <= inputs
    await sdk.close()


async def test_two_edits_at_once_run_on_both_nodes_with_their_images(fakegpus: Any, gateway: Any,
                                                                     tmp_path: Path) -> None:
    a = await fakegpus("comfyui", steps=4, step_ms=30)
    b = await fakegpus("comfyui", steps=4, step_ms=30)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    gw = await gateway(templated(cfg, tmp_path))
    sdk = client(gw)
    pngs = [make_png(f"both{i}") for i in range(2)]
    await asyncio.gather(*(sdk.images.edit(model="invert", image=("p.png", p, "image/png"), prompt="x")
                           for p in pngs))
    held = [{data for (kind, _, _), data in n.backend.images.items() if kind == "input"} for n in (a, b)]
    assert all(held), "both nodes ran an edit"
    assert set(pngs) == held[0] | held[1]
    await sdk.close()


async def test_bad_value_is_400_naming_the_input_and_unknown_template_404(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw = await gateway(templated(base_config({"a": node.url}, kind="comfyui"), tmp_path))
    sdk = client(gw)
    with pytest.raises(openai.BadRequestError) as bad:
        await sdk.images.generate(model="sd15", prompt="x", extra_body={"seed": "lucky"})
    assert "seed" in bad.value.message and bad.value.param == "seed"
    for body, field in (({"size": "big"}, "size"), ({"n": 99}, "n"), ({"prompt": 5}, "prompt")):
        async with http.post(gw.url + "/gen/v1/images/generations", headers=auth(),
                             json={"model": "sd15", "prompt": "x", **body}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and field in err["message"] and err["code"] == "bad_request", (body, err)
            assert err["param"] == field
    # an input the template does not have
    for extra, field in (({"seed": 3}, "seed"), ({"size": "64x64"}, "size"), ({"n": 2}, "n")):
        with pytest.raises(openai.BadRequestError) as bad:
            await sdk.images.generate(model="invert", prompt="x", extra_body=extra)
        assert bad.value.message.startswith(f"Error code: 400 - {field}: template 'invert' has no input"), \
            bad.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        await sdk.images.generate(model="dall-e-3", prompt="x")
    assert nf.value.code == "model_not_found" and "dall-e-3" in nf.value.message
    assert graphs(node) == []  # nothing reached the node
    await sdk.close()


async def test_async_mode_answers_in_openai_shape(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                  tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw = await gateway(templated(base_config({"a": node.url}, kind="comfyui"), tmp_path))
    async with http.post(gw.url + "/gen/v1/images/generations", json={"model": "sd15", "prompt": "x"},
                         headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        text = await r.text()
    assert r.status == 200 and '"b64_json"' in text


def test_config_errors_name_the_file_and_line(tmp_path: Path) -> None:
    cfg = templated(base_config({"a": "http://127.0.0.1:1"}, kind="comfyui"), tmp_path, relative=True)
    cfg["routes"]["gen"]["templates"]["sd15"]["inputs"] = {**TXT2IMG_INPUTS, "seed": "99.inputs.seed"}
    cfg["routes"]["gen"]["templates"]["invert"]["inputs"] = {"image": "10.inputs.picture"}
    cfg["routes"]["gen"]["templates"]["gone"] = {"workflow": "wf/missing.json"}
    (tmp_path / "wf" / "ui.json").write_text(json.dumps({"nodes": [], "links": []}))  # the editor's own format
    cfg["routes"]["gen"]["templates"]["ui"] = {"workflow": "wf/ui.json"}
    cfg["routes"]["gen"]["templates"]["steps"] = {"workflow": "wf/txt2img.json", "inputs": {"steps": "3.inputs.steps"}}
    cfg["routes"]["gen"]["templates"]["link"] = {"workflow": "wf/txt2img.json", "inputs": {"image": "3.inputs.model"}}
    path = tmp_path / "kiloline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    text = "\n".join(e.value.errors)
    assert f"{path}:" in text
    assert "routes.gen.templates.sd15.inputs.seed: the workflow has no node '99'" in text
    assert "routes.gen.templates.invert.inputs.image: node 10 (LoadImage) has no input 'picture'" in text
    assert "routes.gen.templates.gone.workflow: cannot read" in text
    assert "routes.gen.templates.ui.workflow: " in text and "not a workflow in API format" in text
    assert "routes.gen.templates.steps.inputs.steps: unknown field" in text
    assert "routes.gen.templates.link.inputs.image: 3.inputs.model is a link" in text
    cfg["routes"]["gen"]["kind"] = "generic"
    with pytest.raises(ConfigError) as e:
        parse_config(yaml.safe_dump(cfg), env={})
    assert any("routes.gen.templates: only on comfyui routes" in x for x in e.value.errors)


async def test_reload_reads_the_workflow_again(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                              tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw = await gateway(templated(base_config({"a": node.url}, kind="comfyui"), tmp_path))
    sdk = client(gw)
    await sdk.images.generate(model="sd15", prompt="x")
    changed = {**TXT2IMG, "3": {**TXT2IMG["3"], "inputs": {**TXT2IMG["3"]["inputs"], "steps": 1, "cfg": 4.5}}}
    (tmp_path / "wf" / "txt2img.json").write_text(json.dumps(changed))  # the config file is unchanged
    status, _ = await admin_reload(http, gw.url)
    assert status == 200
    await sdk.images.generate(model="sd15", prompt="x", extra_body={"seed": 9})
    before, after = graphs(node)[-2:]
    assert "cfg" not in before["3"]["inputs"]
    assert after["3"]["inputs"]["cfg"] == 4.5 and after["3"]["inputs"]["seed"] == 9
    await sdk.close()


async def test_the_route_cost_reads_the_filled_workflow(fakegpus: Any, gateway: Any, tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    cfg = templated(base_config({"a": node.url}, kind="comfyui", cost={"per_unit": 1, "unit": "megapixels"}),
                    tmp_path)
    cfg["nodes"]["a"]["capacity"] = 1  # a megapixel at once
    gw = await gateway(cfg)
    sdk = client(gw)
    small = await sdk.images.generate(model="sd15", prompt="x", size="512x512")  # 0.26 MP
    assert small.data is not None and len(small.data) == 1
    with pytest.raises(openai.UnprocessableEntityError) as big:
        await sdk.images.generate(model="sd15", prompt="x", size="1024x1024", n=2)  # 2.1 MP
    assert big.value.code == "exceeds_capacity"
    await sdk.close()


async def test_an_edit_whose_node_is_killed_completes_on_the_standby_with_its_image(
        fakegpus: Any, gateway: Any, tmp_path: Path) -> None:
    a = await fakegpus("comfyui", steps=200, step_ms=20)
    b = await fakegpus("comfyui", steps=2, step_ms=5)
    gw = await gateway(templated(base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1),
                                 tmp_path))  # b: the standby
    sdk = client(gw)
    png = make_png("failover")
    edit = asyncio.ensure_future(sdk.images.edit(model="invert", image=("p.png", png, "image/png"), prompt="x"))
    await wait_until(lambda: a.stats["running"] == 1)
    await a.kill()
    got = await asyncio.wait_for(edit, 15)
    assert got.data is not None and base64.b64decode(got.data[0].b64_json or "").startswith(b"\x89PNG")
    assert b.stats["served"] == 1 and png in b.backend.images.values()
    await sdk.close()


async def test_models_list_names_the_templates(fakegpus: Any, gateway: Any, tmp_path: Path) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw = await gateway(templated(base_config({"a": node.url}, kind="comfyui"), tmp_path))
    sdk = client(gw)
    listed = await sdk.models.list()
    assert sorted(m.id for m in listed.data) == ["invert", "sd15"]
    assert all(m.object == "model" for m in listed.data)
    await sdk.close()
