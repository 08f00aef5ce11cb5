"""The gateway against the ComfyUI fake where it now behaves as ComfyUI 0.19.3 (issue 13).

Each test names the issue-13 item it covers; every one failed before the adapter learned it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import aiohttp
import orjson
import pytest
from comfy_client import read_sse
from conftest import auth, base_config, wait_until

from kilolined.adapters.comfy_control import action_of
from kilolined.adapters.comfy_progress import Progress
from kilolined.adapters.comfy_record import EVERYONE, PromptOwners, Viewer
from kilolined.ops.reload import reload_from_file

SSE = {**auth(), "X-KiloLine-Mode": "sse"}


def graph(steps: int, seed: int, samplers: int = 1, fail: bool = False) -> dict[str, Any]:
    nodes: dict[str, Any] = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["6", 0],
                                                   "latent_image": ["5", 0], "seed": seed, "steps": steps}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }
    if samplers == 2:  # a second pass on the first one's latent (hires fix)
        nodes["10"] = {"class_type": "KSampler", "inputs": {**nodes["3"]["inputs"], "latent_image": ["3", 0]}}
        nodes["8"]["inputs"]["samples"] = ["10", 0]
    if fail:
        nodes["8"] = {"class_type": "FailNode", "inputs": {"message": "sampler exploded", "x": ["3", 0]}}
    return nodes


def inflight(gw: Any) -> int:
    return sum(gw.rt.scheduler.node_inflight.values())


async def sync_post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], who: str = "alice") -> Any:
    async with http.post(url, json=body, headers=auth(who)) as r:
        text = await r.read()
        return r.status, orjson.loads(text) if text else None


async def sse_job(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    async with http.post(url, json=body, headers=SSE) as r:
        assert r.status == 200, await r.text()
        return await asyncio.wait_for(read_sse(r), 30)


def monitors(fake: Any) -> list[dict[str, Any]]:
    return [r for r in fake.requests if r["path"] == "/ws" and "kilolined-monitor-" in r["query"]]


# --- 1. which prompt finished ----------------------------------------------------------------

async def test_sync_prompts_reusing_a_finished_id_still_wait_for_the_slot(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    reused = str(uuid.uuid4())
    status, _ = await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(2, 0), "prompt_id": reused})
    assert status == 200
    await wait_until(lambda: fake.stats["served"] == 1)
    fake.reset()

    async def one(seed: int) -> int:
        st, _ = await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(10, seed), "prompt_id": reused})
        return int(st)

    assert await asyncio.gather(*(one(seed) for seed in range(1, 4))) == [200] * 3
    await wait_until(lambda: inflight(gw) == 0)
    # With the slot held until each prompt ends, the card never runs two (3 x 10 GB would not fit).
    assert fake.stats["max_concurrent"] == 1 and fake.stats["oom_count"] == 0 and fake.stats["served"] == 3


# --- 2. freed at once: one monitor socket per node -------------------------------------------

async def test_sync_hold_follows_the_node_monitor_not_a_poll(fakegpus: Any, gateway: Any,
                                                            http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    st, ans = await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(80, 1)})  # ~1.6 s on the card
    assert st == 200
    await wait_until(lambda: inflight(gw) == 0)
    pid = ans["prompt_id"]
    history_gets = [r for r in fake.requests if r["path"] == f"/history/{pid}"]
    # One look per queue change the node broadcast (queued, started, ended), not one every 0.25 s.
    assert len(history_gets) <= 4, len(history_gets)
    assert len(monitors(fake)) == 1
    # A second prompt reuses the same socket, and a fully cached repeat is freed the same way.
    for _ in range(2):
        assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(3, 2)}))[0] == 200
        await wait_until(lambda: inflight(gw) == 0)
    assert len(monitors(fake)) == 1 and fake.stats["ws_clients"] == 1


async def test_monitor_closes_when_its_node_is_removed_and_at_stop(fakegpus: Any, gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    other = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"c": fake.url, "d": other.url}, kind="comfyui", max_concurrency=1)
    gw = await gateway(cfg)
    assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1)}))[0] == 200
    await wait_until(lambda: fake.stats["ws_clients"] == 1)
    cfg["routes"]["gen"].update(nodes=["d"], standby=[])
    del cfg["nodes"]["c"]
    gw.write_config(cfg)
    await reload_from_file(gw.rt, "test")
    await wait_until(lambda: fake.stats["ws_clients"] == 0)
    assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1)}))[0] == 200
    await wait_until(lambda: other.stats["ws_clients"] == 1)
    await gw.server.shutdown()
    await wait_until(lambda: other.stats["ws_clients"] == 0)


async def test_sync_hold_falls_back_to_polling_while_the_monitor_is_down(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1)}))[0] == 200
    await wait_until(lambda: inflight(gw) == 0)
    state = gw.rt.adapter_state["comfyui"]
    node_mon = state.monitors.by_node["c"]
    node_mon.connected = False  # as while it reconnects: frames are not trusted
    assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(20, 2)}))[0] == 200
    await wait_until(lambda: inflight(gw) == 0)


# --- 3. timeout interrupts -------------------------------------------------------------------

async def test_sync_prompt_past_its_timeout_is_interrupted_before_the_slot_is_reused(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    # Steps of 300 ms: an interrupt lands only at the next one, as ComfyUI's does.
    fake = await fakegpus("comfyui", step_ms=300)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, request_timeout_sec=1))
    long, short = await asyncio.gather(sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(500, 1)}),
                                       sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(1, 2)}))
    assert long[0] == short[0] == 200
    await wait_until(lambda: fake.stats["served"] + fake.stats["interrupts"] >= 2 and inflight(gw) == 0)
    assert fake.stats["interrupts"] == 1 and fake.stats["max_concurrent"] == 1


# --- 4. non-GPU endpoints never queue; control endpoints are key-scoped ------------------------

async def _busy(http: aiohttp.ClientSession, gw: Any, fake: Any, who: str = "alice", steps: int = 1000) -> str:
    st, ans = await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(steps, steps)}, who=who)
    assert st == 200
    await wait_until(lambda: fake.stats["running"] >= 1)
    return str(ans["prompt_id"])


async def test_non_gpu_endpoints_pass_a_held_slot(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, queue_timeout_sec=3))
    await _busy(http, gw, fake)
    for path in ("/features", "/api/features", "/userdata?dir=workflows"):
        async with http.get(gw.url + "/gen" + path, headers=auth()) as r:
            assert r.status != 503, path  # a queued request would time out behind the prompt
            assert r.headers.get("X-KiloLine-Node") == "c", path
    for path in ("/api/jobs", "/api/jobs?limit=1"):  # the gateway's own answer, over every node
        async with http.get(gw.url + "/gen" + path, headers=auth()) as r:
            assert r.status == 200 and [j["status"] for j in (await r.json())["jobs"]] == ["in_progress"], path
    form = aiohttp.FormData()
    form.add_field("image", b"\x89PNG\r\n\x1a\n", filename="x.png", content_type="image/png")
    async with http.post(gw.url + "/gen/upload/image", data=form, headers=auth()) as r:
        # Held by the gateway (docs/API.md "ComfyUI over several GPUs"), sent with the prompt that uses it.
        assert r.status == 200 and "X-KiloLine-Node" not in r.headers
    assert fake.stats["running"] == 1  # all answered while the prompt still held the slot
    async with http.post(fake.url + "/interrupt", json={}):
        pass


async def test_interrupt_is_answered_at_once_and_only_for_your_own_prompt(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, queue_timeout_sec=3))
    pid = await _busy(http, gw, fake)
    for body in ({}, {"prompt_id": pid}):
        st, _ = await sync_post(http, gw.url + "/gen/interrupt", body, who="bob")
        assert st == 200
    st, ans = await sync_post(http, gw.url + "/gen/api/jobs/" + pid + "/cancel", {}, who="bob")
    assert (st, ans) == (200, {"cancelled": False})
    assert fake.stats["interrupts"] == 0 and fake.stats["running"] == 1
    st, _ = await sync_post(http, gw.url + "/gen/interrupt", {})  # alice: her running prompt, no id needed
    assert st == 200 and fake.stats["interrupts"] == 1
    await wait_until(lambda: inflight(gw) == 0)
    async with http.get(f"{fake.url}/history/{pid}") as r:
        messages = (await r.json())[pid]["status"]["messages"]
    assert messages[-1][0] == "execution_interrupted"


async def test_queue_clear_and_delete_touch_only_your_own_prompts(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    fake = await fakegpus("comfyui", step_ms=20, parallel=1)  # the node's own queue holds the rest
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=3, queue_timeout_sec=3))
    running = await _busy(http, gw, fake)
    _, alice = await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(5, 11)})
    await wait_until(lambda: fake.stats["pending"] == 1)
    for body in ({"clear": True}, {"delete": [alice["prompt_id"]]}):
        assert (await sync_post(http, gw.url + "/gen/queue", body, who="bob"))[0] == 200
    st, ans = await sync_post(http, gw.url + "/gen/api/jobs/cancel", {"job_ids": [alice["prompt_id"]]}, who="bob")
    assert (st, ans) == (200, {"cancelled": False})
    assert fake.stats["pending"] == 1 and fake.stats["queue_deletes"] == 0
    assert (await sync_post(http, gw.url + "/gen/prompt", {"prompt": graph(5, 12)}, who="bob"))[0] == 200
    await wait_until(lambda: fake.stats["pending"] == 2)
    assert (await sync_post(http, gw.url + "/gen/api/queue", {"clear": True}, who="bob"))[0] == 200
    assert fake.stats["pending"] == 1 and fake.stats["queue_deletes"] == 1  # bob's own one
    assert (await sync_post(http, gw.url + "/gen/queue", {"delete": [alice["prompt_id"]]}))[0] == 200
    assert fake.stats["pending"] == 0 and fake.stats["queue_deletes"] == 2
    st, ans = await sync_post(http, gw.url + f"/gen/api/jobs/{running}/cancel", {})
    assert st == 200 and ans == {"cancelled": True}
    await wait_until(lambda: inflight(gw) == 0)


# --- 5. node lost while running --------------------------------------------------------------

async def test_prompt_on_a_node_that_dies_is_rerouted_to_the_standby(fakegpus: Any, gateway: Any,
                                                                     http: aiohttp.ClientSession) -> None:
    dying = await fakegpus("comfyui", step_ms=20)
    standby = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": dying.url, "d": standby.url}, kind="comfyui", max_concurrency=1))

    async def kill_when_running() -> None:
        await wait_until(lambda: dying.stats["running"] == 1)
        await dying.kill()

    killer = asyncio.create_task(kill_when_running())
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(60, 1)})
    await killer
    names = [n for n, _ in events]
    rerouted = [d for n, d in events if n == "rerouted"]
    assert rerouted and rerouted[0]["from_node"] == "c" and rerouted[0]["to_node"] == "d", names
    assert names[-1] == "output_ready" and standby.stats["served"] == 1 and inflight(gw) == 0


async def test_node_lost_with_no_retry_left_says_so(fakegpus: Any, gateway: Any,
                                                    http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, retry_on_failover=0))

    async def kill_when_running() -> None:
        await wait_until(lambda: fake.stats["running"] == 1)
        await fake.kill()

    killer = asyncio.create_task(kill_when_running())
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(60, 1)})
    await killer
    failed = events[-1]
    assert failed[0] == "failed" and "node lost while running the prompt" in failed[1]["error"]["message"]
    assert inflight(gw) == 0


# --- 6. progress, clean failures, the access log, files ----------------------------------------

async def test_step_progress_of_two_samplers_never_goes_backwards(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(4, 1, samplers=2)})
    progress = [d for n, d in events if n == "step_progress"]
    assert [p["step"] for p in progress] == list(range(1, 9)) and {p["total"] for p in progress} == {8}
    pcts = [p["pct"] for p in progress]
    assert pcts == sorted(pcts) and pcts[-1] == 100


def test_progress_without_progress_state_follows_node_order() -> None:
    p = Progress(graph(4, 1, samplers=2))
    seen = []
    for nid in ("3", "10"):
        p.started(nid)
        for v in range(1, 5):
            p.step(nid, v, 4)
            got = p.report()
            if got:
                seen.append(got)
    assert seen == [(s, 8) for s in range(1, 9)]
    # A node that reports steps nobody announced never pulls the bar back.
    p.step("99", 1, 100)
    assert p.report() is None


async def test_failed_job_result_has_no_traceback(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1, fail=True)})
    assert events[-1][0] == "failed" and events[-1][1]["error"]["message"] == "sampler exploded"
    async with http.get(gw.url + events[0][1]["result_url"]) as r:
        text = await r.text()
    assert "sampler exploded" in text
    assert "traceback" not in text and ".py" not in text and 'File \\"' not in text


async def test_sse_access_log_names_node_and_bytes(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    with caplog.at_level(logging.INFO, logger="kilolined.access"):
        await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1)})
        await asyncio.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "kilolined.access" and " sse " in r.getMessage()]
    assert lines and " gen c sse 200 " in lines[-1] and " bytes=0" not in lines[-1], lines


async def test_file_index_out_of_range_is_no_such_file(fakegpus: Any, gateway: Any,
                                                       http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(2, 1)})
    url = events[-1][1]["result"]["outputs"]["9"]["images"][0]["url"]
    for n in ("1", "-1", "x"):
        async with http.get(gw.url + url.replace("/files/0", f"/files/{n}")) as r:
            body = await r.json()
            assert r.status == 404 and body["error"]["message"] == "no such file", n


def test_prompt_owners_are_bounded_and_per_key() -> None:
    owners = PromptOwners(cap=2)
    for pid in ("a", "b", "c"):
        owners.add(pid, "alice", "n1")
    # the oldest was forgotten; bob acts on none of them, the admin (None) on all
    assert owners.mine("alice") == {"b": "n1", "c": "n1"} and owners.mine("bob") == {}
    assert owners.mine(None) == {"b": "n1", "c": "n1"}


def test_the_record_keeps_a_bounded_history_in_the_order_prompts_ended() -> None:
    owners = PromptOwners(cap=4, entries_cap=2)
    for pid in ("a", "b", "c", "d"):
        owners.add(pid, "alice" if pid != "b" else "bob", "n1")
    for pid in ("c", "a", "b", "d"):  # ended in this order
        owners.end(pid, {"prompt": [0, pid, {}, {}, []]})
    # only the last two entries are kept; the others' owners are still known
    assert [pid for pid, _ in owners.history(EVERYONE)] == ["b", "d"]
    assert [pid for pid, _ in owners.history(Viewer("alice"))] == ["d"]
    assert owners.get("c") is not None and owners.get("c").entry is None  # type: ignore[union-attr]
    assert owners.waiting(EVERYONE) == {}
    owners.add("b", "bob", "n2")  # a reused id runs again: out of the history until it ends
    assert [pid for pid, _ in owners.history(EVERYONE)] == ["d"] and list(owners.waiting(Viewer("bob"))) == ["b"]


def test_control_paths() -> None:
    assert [action_of("POST", p) for p in ("/interrupt", "/api/interrupt", "/queue", "/api/queue",
                                           "/api/jobs/x/cancel", "/api/jobs/cancel")] == \
        ["interrupt", "interrupt", "queue", "queue", "cancel", "cancel_many"]
    assert action_of("GET", "/queue") is None and action_of("POST", "/prompt") is None
    assert action_of("POST", "/api/jobs//cancel") is None and action_of("POST", "/jobs/x/cancel") is None
