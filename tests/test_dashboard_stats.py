"""The dashboard's route percentiles and cost panel, in a real headless Chromium against a live
gateway (the browser fixture and Page helper are tests/test_dashboard.py's).

A route's p50/p95 count GPU work only; polls and refusals are shown apart. The cost panel shows
with either price, and bills each machine once however many nodes (servers) it runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from conftest import ADMIN_KEY, auth, base_config
from test_dashboard import ROUTE, Page, browser  # noqa: F401  (browser is a fixture)

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


async def test_route_percentiles_count_gpu_work_not_polls_or_refusals(fakegpus, gateway, http, browser) -> None:  # noqa: F811
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
