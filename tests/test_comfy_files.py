"""One ComfyUI over two nodes: inputs follow the prompt, outputs leave the node (SPEC §16), end to
end over loopback with two fake ComfyUI nodes of one slot each."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from comfy_files_client import ASYNC, images, img2img, run_job, two_nodes, upload, view
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.adapters.comfy_store import executed_for_client
from kilolined.fakegpu.comfy_graph import make_png


async def test_upload_is_held_and_answered_as_comfyui(fakegpus: Any, gateway: Any,
                                                      http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    gw = await gateway(two_nodes(a, b))
    png, other = make_png("cat"), make_png("dog")
    assert await upload(http, gw.url, "cat.png", png) == {"name": "cat.png", "subfolder": "", "type": "input"}
    # The same bytes again: the same file. Other bytes under the name: ComfyUI's "name (1)".
    assert (await upload(http, gw.url, "cat.png", png))["name"] == "cat.png"
    assert (await upload(http, gw.url, "cat.png", other))["name"] == "cat (1).png"
    assert (await upload(http, gw.url, "cat.png", other, overwrite="true"))["name"] == "cat.png"
    # Held by the gateway, not sent to a node at upload time.
    assert a.backend.images == {} and b.backend.images == {}
    status, body = await view(http, gw, {"filename": "cat (1).png", "subfolder": "", "type": "input"})
    assert status == 200 and body == other
    assert gw.rt.metrics.comfy_uploads.labels("gen").value == 4


async def test_an_upload_over_the_bound_is_refused(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def no_disk(*_a: Any, **_k: Any) -> None:
        raise AssertionError("an upload went to a temporary file")

    monkeypatch.setattr(aiohttp.web_request, "SpooledTemporaryFile", no_disk)  # what request.post() spools to
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    cfg = two_nodes(a, b)
    cfg["routes"]["gen"]["comfy"] = {"max_files_mb": 2}
    gw = await gateway(cfg)
    big = b"\x89PNG" + bytes(3 * 1024 * 1024)
    form = aiohttp.FormData()
    form.add_field("image", big, filename="big.png", content_type="image/png")
    async with http.post(gw.url + "/gen/upload/image", data=form, headers=auth()) as r:
        assert r.status == 413 and (await r.json())["error"]["type"] == "payload_too_large"
    # 1.5 MB (past aiohttp's 1 MiB spool to disk): held, in memory.
    assert (await upload(http, gw.url, "ok.png", big[: 3 * 1024 * 1024 // 2]))["name"] == "ok.png"
    assert gw.rt.adapter_state["comfyfiles"].files("gen").held().files == 1


async def test_twenty_img2img_prompts_over_two_nodes(fakegpus: Any, gateway: Any,
                                                     http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    gw = await gateway(two_nodes(a, b))
    names = [(await upload(http, gw.url, f"in{i}.png", make_png(f"in{i}")))["name"] for i in range(20)]
    results = await asyncio.gather(*(run_job(http, gw, img2img(n)) for n in names))
    assert a.stats["served"] > 0 and b.stats["served"] > 0  # both nodes ran some
    assert a.stats["served"] + b.stats["served"] == 20
    outs = [img for res in results for img in images(res)]
    # Both nodes numbered their outputs from 1: the route's names are all different.
    assert len({o["filename"] for o in outs}) == 20
    # Every output downloadable after both nodes are gone (copied off the node at the end).
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    await a.kill()
    await b.kill()
    bodies = set()
    for o in outs:
        status, body = await view(http, gw, o)
        assert status == 200 and body.startswith(b"\x89PNG")
        bodies.add(body)
    assert len(bodies) == 20


async def test_sync_prompt_takes_its_input_to_the_node(fakegpus: Any, gateway: Any,
                                                       http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    gw = await gateway(two_nodes(a, b))
    name = (await upload(http, gw.url, "cat.png", make_png("cat")))["name"]
    for _ in range(4):
        async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(name)}, headers=auth()) as r:
            assert r.status == 200, await r.text()
    await wait_until(lambda: a.stats["served"] + b.stats["served"] == 4)
    # Delivered once per node that ran one.
    assert ("input", "", "cat.png") in a.backend.images and ("input", "", "cat.png") in b.backend.images
    # A node that lost its files (a rented machine back with a fresh disk) is sent them again.
    served = a.stats["served"] + b.stats["served"]
    del a.backend.images[("input", "", "cat.png")]
    del b.backend.images[("input", "", "cat.png")]
    for _ in range(2):
        async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(name)}, headers=auth()) as r:
            assert r.status == 200, await r.text()
    await wait_until(lambda: a.stats["served"] + b.stats["served"] == served + 2)
    # An inline input: the node gets the graph with the held file's name, and the file.
    inline = "data:image/png;base64," + base64.b64encode(make_png("inline")).decode()
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(inline)}, headers=auth()) as r:
        assert r.status == 200, await r.text()
        pid = (await r.json())["prompt_id"]
    await wait_until(lambda: pid in a.backend.history or pid in b.backend.history)
    entry = a.backend.history.get(pid) or b.backend.history[pid]
    assert entry["status"]["status_str"] == "success"
    assert entry["prompt"][2]["1"]["inputs"]["image"].startswith("kl_")
    # A name the gateway does not hold goes as it is: the node answers ComfyUI's validation error.
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img("nope.png")}, headers=auth()) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"]["errors"][0]["details"] == "image - Invalid image file: nope.png"


async def test_primary_killed_mid_prompt_completes_on_standby_with_its_input(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=200, step_ms=20)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)  # b is the standby
    gw = await gateway(cfg)
    name = (await upload(http, gw.url, "cat.png", make_png("cat")))["name"]
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(name)}, headers={**auth(), **ASYNC}) as r:
        job_id = (await r.json())["job_id"]
    await wait_until(lambda: a.stats["running"] == 1)
    assert ("input", "", "cat.png") in a.backend.images and b.backend.images == {}
    await a.kill()
    await wait_until(lambda: gw.jobs.jobs[job_id].status in ("completed", "failed"), timeout=15)
    job = gw.jobs.jobs[job_id]
    assert job.status == "completed", job.events
    assert ("input", "", "cat.png") in b.backend.images and b.stats["served"] == 1
    status, body = await view(http, gw, images(job.result.result)[0])
    assert status == 200
    # The job's own file URL too, once the node that made it is gone.
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    await b.kill()
    async with http.get(gw.url + images(job.result.result)[0]["url"]) as r:
        assert r.status == 200 and await r.read() == body


async def test_a_key_cannot_view_another_keys_output(fakegpus: Any, gateway: Any,
                                                     http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    gw = await gateway(two_nodes(a, b))
    name = (await upload(http, gw.url, "cat.png", make_png("cat")))["name"]
    res = await run_job(http, gw, img2img(name))
    out = images(res)[0]
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    assert (await view(http, gw, out))[0] == 200
    assert (await view(http, gw, out, who="bob"))[0] == 404
    assert (await view(http, gw, {"filename": name, "subfolder": "", "type": "input"}, who="bob"))[0] == 404
    # bob's prompt naming alice's upload: ComfyUI's answer for a file that is not there, although
    # the node that ran alice's prompt has it.
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img("cat.png")},
                         headers=auth("bob")) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"] == {
        "errors": [{"type": "custom_validation_failed", "message": "Custom validation failed for node",
                    "details": "image - Invalid image file: cat.png", "extra_info": {"input_name": "image"}}],
        "dependent_outputs": ["3"], "class_type": "LoadImage"}
    assert a.stats["served"] + b.stats["served"] == 1
    await wait_until(lambda: sum(gw.rt.scheduler.node_inflight.values()) == 0)  # the refusal freed its slot


async def test_data_url_input_is_held_and_delivered(fakegpus: Any, gateway: Any,
                                                     http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    gw = await gateway(two_nodes(a, b))
    png = make_png("inline")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    res = await run_job(http, gw, img2img(url))
    sent = res["prompt"][2]["1"]["inputs"]["image"]
    assert sent.startswith("kl_") and sent.endswith(".png")
    assert any(img == png for (kind, _, _), img in {**a.backend.images, **b.backend.images}.items()
               if kind == "input")


@pytest.fixture
async def origin() -> Any:
    """A plain web server to fetch inputs from."""
    app = web.Application()
    png = make_png("fetched")
    app.router.add_get("/img/cat.png", lambda _r: web.Response(body=png, content_type="image/png"))
    app.router.add_get("/redirect", lambda _r: web.HTTPFound("/img/cat.png"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", png
    await runner.cleanup()


async def test_fetched_inputs_only_where_fetch_inputs_allows(fakegpus: Any, gateway: Any, origin: Any,
                                                             http: aiohttp.ClientSession) -> None:
    base, png = origin
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    cfg = two_nodes(a, b)
    cfg["routes"]["gen"]["comfy"] = {"fetch_inputs": [base + "/img/*"]}
    gw = await gateway(cfg)
    res = await run_job(http, gw, img2img(base + "/img/cat.png"))
    assert res["prompt"][2]["1"]["inputs"]["image"].startswith("kl_")
    assert any(img == png for img in {**a.backend.images, **b.backend.images}.values())
    # Outside the globs (a redirect too): passed on as it is, fetched by nobody.
    for url in (base + "/redirect", base.replace("127.0.0.1", "localhost") + "/img/cat.png"):
        async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(url)}, headers=auth()) as r:
            assert r.status == 400
            assert "Invalid image file: " + url in (await r.text())


async def test_admin_state_shows_files(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    gw = await gateway(two_nodes(a, b))
    png = make_png("cat")
    await upload(http, gw.url, "cat.png", png)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = await r.json()
    assert state["routes"]["gen"]["comfy_files"] == {"files": 1, "bytes": len(png)}
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    assert f'kiloline_comfy_files_bytes{{route="gen"}} {float(len(png))}' in text
    assert 'kiloline_comfy_uploads_total{route="gen"} 1.0' in text


# --- the bucket: a real S3-compatible server (moto's), checked with boto3 ------------------------

@pytest.fixture
async def moto() -> Any:
    """moto's S3 server on a loopback port, checking signatures: a user with S3 rights and one
    bucket are made before it starts refusing unsigned or badly signed calls (its first
    INITIAL_NO_AUTH_ACTION_COUNT actions)."""
    boto3 = pytest.importorskip("boto3")
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "4"}
    proc = await asyncio.create_subprocess_exec(exe, "-H", "127.0.0.1", "-p", str(port), env=env,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            async def up() -> bool:
                try:
                    async with s.get(endpoint + "/moto-api/") as r:
                        return r.status < 500
                except aiohttp.ClientError:
                    return False
            await wait_until(up, timeout=20, step=0.1)

        def setup() -> tuple[str, str, Any]:
            root = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "x",
                    "aws_secret_access_key": "x"}
            iam = boto3.client("iam", **root)
            iam.create_user(UserName="kl")
            key = iam.create_access_key(UserName="kl")["AccessKey"]
            iam.put_user_policy(UserName="kl", PolicyName="s3", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                  aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
            client.create_bucket(Bucket="comfy-out")
            return key["AccessKeyId"], key["SecretAccessKey"], client

        yield endpoint, *await asyncio.to_thread(setup)
    finally:
        proc.terminate()
        await proc.wait()


async def test_outputs_go_to_the_bucket_and_are_served_from_it(fakegpus: Any, gateway: Any, moto: Any,
                                                               http: aiohttp.ClientSession) -> None:
    endpoint, access_key, secret_key, client = moto
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    b = await fakegpus("comfyui", steps=2, step_ms=10)
    cfg = two_nodes(a, b)
    cfg["routes"]["gen"]["comfy"] = {"store": {"s3": {
        "endpoint": endpoint, "bucket": "comfy-out", "region": "us-east-1", "access_key": access_key,
        "secret_key": secret_key, "prefix": "kl/"}}}
    gw = await gateway(cfg)
    name = (await upload(http, gw.url, "cat.png", make_png("cat")))["name"]
    out = images(await run_job(http, gw, img2img(name)))[0]
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    obj = await asyncio.to_thread(client.get_object, Bucket="comfy-out", Key=f"kl/gen/output/{out['filename']}")
    data = obj["Body"].read()
    assert data.startswith(b"\x89PNG") and obj["Metadata"]["owners"] == "alice"
    assert obj["ContentType"] == "image/png"
    await a.kill()
    await b.kill()
    assert await view(http, gw, out) == (200, data)
    # Forgotten by the gateway (a restart): found in the bucket, still alice's only.
    gw.rt.adapter_state["comfyfiles"].routes.clear()
    assert (await view(http, gw, out, who="bob"))[0] == 404
    assert await view(http, gw, out) == (200, data)


async def test_mask_is_painted_on_a_node_and_held(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    gw = await gateway(two_nodes(a, b))
    photo, mask = make_png("photo"), make_png("mask")
    await upload(http, gw.url, "photo.png", photo)
    ref = json.dumps({"filename": "photo.png", "subfolder": "", "type": "input"})

    async def mask_upload(who: str) -> aiohttp.ClientResponse:
        form = aiohttp.FormData()
        form.add_field("image", mask, filename="clipspace-mask-1.png", content_type="image/png")
        form.add_field("original_ref", ref)
        form.add_field("type", "input")
        return await http.post(gw.url + "/gen/upload/mask", data=form, headers=auth(who))

    async with await mask_upload("alice") as r:
        assert r.status == 200 and await r.json() == {"name": "clipspace-mask-1.png", "subfolder": "", "type": "input"}
    painted = make_png("mask:" + hashlib.sha256(photo).hexdigest() + hashlib.sha256(mask).hexdigest())
    held = {"filename": "clipspace-mask-1.png", "subfolder": "", "type": "input"}
    assert await view(http, gw, held) == (200, painted)
    async with await mask_upload("bob") as r:
        assert r.status == 404  # bob may not read alice's photo


async def test_an_output_named_before_its_copy_streams_from_its_node(fakegpus: Any, gateway: Any,
                                                                     http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    gw = await gateway(two_nodes(a, b))
    png = make_png("made on b")
    a.backend.images[("output", "", "ComfyUI_00001_.png")] = make_png("a's own")
    b.backend.images[("output", "", "ComfyUI_00001_.png")] = png
    # What the route's socket tells a client when b's SaveImage ran (comfy_store.executed_for_client):
    first = executed_for_client(gw.rt, "gen", "a", "alice", {"output": {"images": [
        {"filename": "ComfyUI_00001_.png", "subfolder": "", "type": "output"}]}})
    data = executed_for_client(gw.rt, "gen", "b", "alice", {"node": "9", "output": {"images": [
        {"filename": "ComfyUI_00001_.png", "subfolder": "", "type": "output"}]}})
    assert first["output"]["images"][0]["filename"] == "ComfyUI_00001_.png"
    img = data["output"]["images"][0]
    assert img["filename"] == "ComfyUI_00002_.png" and data["node"] == "9"
    assert await view(http, gw, img) == (200, png)  # not copied yet: from b, under b's name
    assert (await view(http, gw, img, who="bob"))[0] == 404
    await b.kill()
    assert (await view(http, gw, img))[0] == 404  # never copied, and its node is gone


async def test_the_bucket_never_overwrites_a_file_under_the_same_name(fakegpus: Any, gateway: Any, moto: Any,
                                                                     http: aiohttp.ClientSession) -> None:
    """A name another gateway (or this one before a restart) gave to another key's file."""
    endpoint, access_key, secret_key, client = moto
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    cfg = base_config({"a": a.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"]["comfy"] = {"store": {"s3": {"endpoint": endpoint, "bucket": "comfy-out",
                                                      "access_key": access_key, "secret_key": secret_key}}}
    gw = await gateway(cfg)
    await asyncio.to_thread(client.put_object, Bucket="comfy-out", Key="gen/output/ComfyUI_00001_.png",
                            Body=b"carol's", Metadata={"owners": "carol"})
    name = (await upload(http, gw.url, "cat.png", make_png("cat")))["name"]
    out = images(await run_job(http, gw, img2img(name)))[0]
    assert out["filename"] == "ComfyUI_00001_.png"  # this gateway knew of no such file
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    obj = await asyncio.to_thread(client.get_object, Bucket="comfy-out", Key="gen/output/ComfyUI_00001_.png")
    assert obj["Body"].read() == b"carol's"
    status, body = await view(http, gw, out)  # alice's own, from its node while it lives
    assert status == 200 and body.startswith(b"\x89PNG")
    assert (await view(http, gw, out, who="carol"))[0] == 404

