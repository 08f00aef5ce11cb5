"""The dashboard's route percentiles and cost panel, in a real headless Chromium against a live
gateway (the browser fixture and Page helper are tests/test_dashboard.py's).

A route's p50/p95 count GPU work only; polls and refusals are shown apart. The cost panel shows
with either price, and bills each machine once however many nodes (servers) it runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from browser_page import ROUTE, Page
from conftest import ADMIN_KEY, auth, base_config

from kilolined.ops.stats import machines

RENDER_SEC = 2.0  # the fake card's 20 steps × 100 ms


async def sign_in(page: Page, url: str) -> None:
    await page.call(page.d.get, url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    await page.until("document.querySelector('#conn').dataset.state === 'live'", "the stream live")


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
        assert r.status == 200
        return await r.json()


async def test_route_percentiles_count_gpu_work_not_polls_or_refusals(fakegpus, gateway, http, browser) -> None:
    gpu = await fakegpus(steps=20, step_ms=100)
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=2, unqueued_paths=["GET /health"]))

    async def render() -> int:
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth(),
                             timeout=aiohttp.ClientTimeout(total=30)) as r:
            await r.read()
            return r.status

    async def get(path: str, headers: dict[str, str]) -> int:
        async with http.get(gw.url + path, headers=headers) as r:
            await r.read()
            return r.status

    renders = [asyncio.create_task(render()) for _ in range(2)]
    # While the renders run: many fast status polls (unqueued) and refusals (bad key).
    polls = [await get("/gen/health", auth()) for _ in range(30)]
    refused = [await get("/gen/health", {"Authorization": "Bearer kl_wrong"}) for _ in range(30)]
    assert polls == [200] * 30 and refused == [401] * 30
    assert await asyncio.gather(*renders) == [200] * 2

    st = (await admin_state(http, gw.url))["stats"]["routes"]["gen"]
    assert st["outcomes"] == {"200": 32, "401": 30}
    assert st["duration_p50"] >= RENDER_SEC and st["duration_p95"] >= RENDER_SEC
    assert st["work_requests"] == 2 and st["other_requests"] == 60
    assert st["other_duration_p95"] < RENDER_SEC  # the polls and 401s never waited for the card

    page = Page(browser)
    await sign_in(page, gw.url)
    other = f"{ROUTE} [data-field=other]"
    await page.until(f"document.querySelector('{other}')?.dataset.count === '60'", "the polls counted apart")
    for f in ("duration_p50", "duration_p95"):
        shown = await page.text(f"{ROUTE} [data-field={f}]")
        assert shown is not None and shown.endswith(" s") and float(shown[:-2]) >= RENDER_SEC, (f, shown)
    assert (await page.text(other)).startswith("+ 60 not run on a GPU")


def test_machines_are_counted_by_url_host() -> None:
    assert machines([]) == 0
    # ComfyUI and a TTS server on one rented box: two nodes, one machine.
    assert machines(["http://203.0.113.7:8188", "http://203.0.113.7:5002/tts"]) == 1
    assert machines(["http://203.0.113.7:8188", "https://198.51.100.4:8188"]) == 2
    assert machines(["http://GPU-A.example:8188", "http://gpu-a.example:5002"]) == 1
    assert machines(["http://[2001:db8::1]:8188", "http://[2001:db8::1]:5002", "http://[2001:db8::2]:80"]) == 2


async def test_cost_panel_with_the_hourly_price_alone_bills_a_shared_machine_once(
        fakegpus, gateway, http, browser) -> None:
    comfy, tts = await fakegpus(), await fakegpus()  # two servers on one host (127.0.0.1)
    cfg = base_config({"comfy": comfy.url, "tts": tts.url})
    cfg["routes"]["tts"] = {"path": "/tts", "nodes": ["tts"], "max_concurrency": 1}
    cfg["cost"] = {"gpu_hourly_usd": 3600}  # $1 per second rented: the bill reads as seconds
    gw = await gateway(cfg)
    assert (await admin_state(http, gw.url))["cost"] == {
        "gpu_hourly_usd": 3600, "serverless_per_sec_usd": None, "machines": 1}

    page = Page(browser)
    await sign_in(page, gw.url)
    await page.until("!document.querySelector('#cost').hidden", "the cost panel with one price")
    assert await page.js("return document.querySelector('#cost').dataset.machines") == "1"
    rented = await page.until("document.querySelector('#cost [data-field=gpu_seconds]').textContent",
                              "the rented time")
    assert rented.endswith("rented (1 machine)"), rented
    gpu_usd = await page.text("#cost [data-field=gpu_usd]")
    assert gpu_usd is not None and gpu_usd.startswith("$"), gpu_usd
    assert await page.text("#cost [data-field=serverless_usd]") == "—"
    assert await page.text("#cost [data-field=ratio_note]") == "set cost.serverless_per_sec_usd to compare"


async def test_cost_panel_with_the_serverless_price_alone(fakegpus, gateway, http, browser) -> None:
    gpu = await fakegpus(steps=2, step_ms=50)
    cfg = base_config({"a": gpu.url})
    cfg["cost"] = {"serverless_per_sec_usd": 0.0011}
    gw = await gateway(cfg)
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 200
    page = Page(browser)
    await sign_in(page, gw.url)
    await page.until("!document.querySelector('#cost').hidden", "the cost panel with one price")
    sl = await page.until("document.querySelector('#cost [data-field=serverless_usd]').textContent.startsWith('$')"
                          " && document.querySelector('#cost [data-field=serverless_usd]').textContent",
                          "the serverless bill for the leased seconds")
    assert sl.startswith("$")
    assert await page.text("#cost [data-field=gpu_usd]") == "—"
    assert await page.text("#cost [data-field=gpu_rate]") == "no GPU price"
