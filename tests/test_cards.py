"""Cards end to end (docs/CONFIG.md#cards): two fake GPUs stand for two servers on one card, the real
gateway in front of them over loopback sockets; the cap is counted at the fakes."""

from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.fakegpu import FakeGPU
from kilolined.fakegpu.card import Job

EXAMPLE = Path(__file__).resolve().parent.parent / "etc" / "kiloline.yaml"


class SharedCard:
    """What the fakes run at once, together: the peak is taken at each job's start on either."""

    def __init__(self, *gpus: FakeGPU) -> None:
        self.gpus = gpus
        self.peak = 0
        for g in gpus:
            self._watch(g)

    def running(self) -> int:
        return sum(g.stats["running"] for g in self.gpus)

    def _watch(self, gpu: FakeGPU) -> None:
        begin = gpu.begin_job

        def counted(vram_gb: float | None = None) -> Job:
            job = begin(vram_gb)
            self.peak = max(self.peak, self.running())
            return job

        gpu.begin_job = counted  # type: ignore[method-assign]


def example_config(comfy_url: str, tts_url: str) -> dict[str, Any]:
    """The example's card, its ComfyUI and TTS nodes and their routes, as etc/kiloline.yaml has
    them (its caps, not its standby, LLM box or per-route rate), in front of the fakes."""
    ex = yaml.safe_load(EXAMPLE.read_text())
    cfg = base_config({"x": comfy_url})
    cfg["cards"] = ex["cards"]
    cfg["nodes"] = {n: {**ex["nodes"][n], "url": url} for n, url in (("vast-8410", comfy_url),
                                                                        ("vast-8410-tts", tts_url))}
    routes = {r: copy.deepcopy(ex["routes"][r]) for r in ("comfy", "tts")}
    for r in routes.values():
        r.pop("standby", None)
        r.pop("rate", None)
    cfg["routes"] = routes
    return cfg


def graph() -> dict[str, Any]:
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "3": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "latent_image": ["5", 0], "seed": 1,
                                                   "steps": 5}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }


async def image(http: aiohttp.ClientSession, url: str) -> str:
    """One ComfyUI prompt through the gateway, over SSE to its end; the last event's name."""
    last = ""
    async with http.post(url + "/comfy/prompt", json={"prompt": graph()},
                         headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("event:"):
                last = line[6:].strip()
    return last


async def voice(http: aiohttp.ClientSession, url: str, route: str = "tts") -> int:
    async with http.post(f"{url}/{route}/generate", json={"text": "hello"}, headers=auth()) as r:
        await r.read()
        return r.status


async def state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return dict(await r.json())


async def metric(http: aiohttp.ClientSession, url: str, name: str, card: str) -> float:
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    m = re.search(rf'^{name}{{card="{card}"}} (\S+)$', text, re.M)
    assert m is not None, f"{name} for {card} missing"
    return float(m.group(1))


async def test_the_examples_comfyui_and_tts_never_run_more_than_their_card_allows(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    """The README's 4090: an image route of 1 slot and a voice route of 4, on one card of 4."""
    comfy: FakeGPU = await fakegpus("comfyui", steps=5, step_ms=30)
    tts: FakeGPU = await fakegpus("generic", steps=5, step_ms=30, job_vram_gb=2)  # a voice model is small
    card = SharedCard(comfy, tts)
    cfg = example_config(comfy.url, tts.url)
    cap = cfg["cards"]["vast-8410-4090"]["max_concurrency"]
    assert cfg["routes"]["comfy"]["max_concurrency"] + cfg["routes"]["tts"]["max_concurrency"] > cap
    gw = await gateway(cfg)
    results = await asyncio.gather(*(image(http, gw.url) for _ in range(4)),
                                   *(voice(http, gw.url) for _ in range(12)))
    assert results[:4] == ["output_ready"] * 4 and results[4:] == [200] * 12
    assert card.peak == cap, f"{card.peak} ran at once on a card of {cap}"
    st = await state(http, gw.url)
    assert st["cards"] == {"vast-8410-4090": {"max_concurrency": cap, "capacity": None, "inflight": 0,
                                              "capacity_used": 0, "nodes": ["vast-8410", "vast-8410-tts"]}}
    assert st["nodes"]["vast-8410"]["card"] == st["nodes"]["vast-8410-tts"]["card"] == "vast-8410-4090"


def two_on_one_card(a: str, b: str, card: dict[str, Any]) -> dict[str, Any]:
    """Routes gen (node a) and gen2 (node b), 4 slots each, costing 4; a and b on card gpu."""
    cfg = base_config({"a": a}, max_concurrency=4, queue_timeout_sec=60, cost={"base": 4})
    cfg["routes"]["gen2"] = {**cfg["routes"]["gen"], "path": "/gen2", "nodes": ["b"]}
    cfg["nodes"] = {"a": {"url": a, "card": "gpu"}, "b": {"url": b, "card": "gpu"}}
    cfg["cards"] = {"gpu": card}
    return cfg


async def test_a_card_is_live_on_reload_and_visible_in_state_and_metrics(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a: FakeGPU = await fakegpus("generic", steps=10, step_ms=40)
    b: FakeGPU = await fakegpus("generic", steps=10, step_ms=40)
    card = SharedCard(a, b)
    cfg = two_on_one_card(a.url, b.url, {"max_concurrency": 1})
    gw = await gateway(cfg)
    burst = asyncio.gather(*(voice(http, gw.url, r) for r in ["gen", "gen2"] * 4))

    async def one_running_and_some_waiting() -> bool:
        st = await state(http, gw.url)
        return bool(st["cards"]["gpu"]["inflight"] == 1
                    and st["routes"]["gen"]["queue_depth"] + st["routes"]["gen2"]["queue_depth"] >= 4)

    await wait_until(one_running_and_some_waiting)
    st = await state(http, gw.url)
    assert (st["nodes"]["a"]["slots"], st["routes"]["gen"]["slots"]) == (1, 1)  # 4 each, 1 on the card
    assert await metric(http, gw.url, "kiloline_card_inflight", "gpu") == 1
    assert await metric(http, gw.url, "kiloline_card_capacity_used", "gpu") == 4
    assert card.peak == 1
    # Raised live, with a capacity that holds two of these requests: two run at once from now on.
    cfg["cards"]["gpu"] = {"max_concurrency": 3, "capacity": 8}
    gw.path.write_text(yaml.safe_dump(cfg))
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    assert await burst == [200] * 8
    assert card.peak == 2, f"{card.peak} ran at once on a card with room for 2"
    st = await state(http, gw.url)
    assert st["cards"]["gpu"] == {"max_concurrency": 3, "capacity": 8, "inflight": 0, "capacity_used": 0,
                                  "nodes": ["a", "b"]}
    assert await metric(http, gw.url, "kiloline_card_inflight", "gpu") == 0


async def test_a_request_larger_than_its_card_is_422_at_once(fakegpus: Any, gateway: Any,
                                                             http: aiohttp.ClientSession) -> None:
    a: FakeGPU = await fakegpus("generic")
    b: FakeGPU = await fakegpus("generic")
    gw = await gateway(two_on_one_card(a.url, b.url, {"capacity": 3}))
    assert await voice(http, gw.url, "gen") == 422
    assert a.requests == []
